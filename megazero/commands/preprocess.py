"""`megazero preprocess`: Tokenize jsonl, parquet or Hugging Face datasets into Megatron-format .bin/.idx shards."""

from megazero.errors import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser("preprocess", help="Tokenize jsonl, parquet or Hugging Face datasets into Megatron-format .bin/.idx shards (not built yet)",
                                   description="Tokenize jsonl, parquet or Hugging Face datasets into Megatron-format .bin/.idx shards. Not built yet: this command only says so.")
    parser.set_defaults(func=run)


def run(args) -> int:
    raise UserError("'megazero preprocess' is not implemented yet in this version")
