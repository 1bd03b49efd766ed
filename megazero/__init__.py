"""megazero: pretrain GPT decoders with tensor slicing, 1F1B pipelines and ZeRO data parallelism."""

__version__ = "0.1.0"
