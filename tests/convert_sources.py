"""Sources shared by the tests of `megazero convert`: a Llama folder saved by transformers, a source
of random weights in an architecture of the test's choosing, a Megatron-LM checkpoint written by
hand, and the check that a bad input is one line with nothing written."""

from __future__ import annotations

from pathlib import Path

import torch

from megazero.cli import main
from models.config import ModelConfig


def fails(capsys, tmp_path, *args, dst=None) -> str:
    """Run `megazero convert ARGS DST`, which must fail with exit status 2, one line on stderr (returned)
    and nothing at DST, not even a temporary folder beside it."""
    dst = dst or tmp_path / "out"
    capsys.readouterr()
    assert main(["convert", *map(str, args), str(dst)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not dst.exists() and not list(dst.parent.glob(f".{dst.name}.*")), list(dst.parent.iterdir())
    return err


def megatron_checkpoint(root: Path, drop=(), ranks: int = 1, **changes) -> Path:
    """A Megatron-LM GPT checkpoint written by hand (no megatron-core needed): args as a Namespace,
    one ``model`` dict per tp rank (each holding whole tensors but its share of the 128 vocabulary
    rows: the argument checks come first, and the first tensor checked fits)."""
    import argparse

    hidden, layers, seq, ffn = 16, 2, 8, 64
    args = dict(num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=4,
                padded_vocab_size=128, max_position_embeddings=seq, seq_length=seq, bias_gelu_fusion=True)
    args = {k: v for k, v in {**args, **changes}.items() if k not in drop}
    model = {"embedding.word_embeddings.weight": torch.randn(128 // ranks, hidden),
             "embedding.position_embeddings.weight": torch.randn(seq, hidden),
             "decoder.final_layernorm.weight": torch.ones(hidden), "decoder.final_layernorm.bias": torch.zeros(hidden)}
    for i in range(layers):
        for name, rows, cols in (("input_layernorm", hidden, 0), ("pre_mlp_layernorm", hidden, 0),
                                 ("self_attention.linear_qkv", 3 * hidden, hidden),
                                 ("self_attention.linear_proj", hidden, hidden), ("mlp.linear_fc1", ffn, hidden),
                                 ("mlp.linear_fc2", hidden, ffn)):
            model[f"decoder.layers.{i}.{name}.weight"] = torch.randn(rows, cols) if cols else torch.ones(rows)
            model[f"decoder.layers.{i}.{name}.bias"] = torch.zeros(rows)
    for t in range(ranks):
        folder = root / "iter_0000005" / f"mp_rank_{t:02d}"
        folder.mkdir(parents=True)
        torch.save({"args": argparse.Namespace(**args), "model": model}, folder / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("5")
    return root


def llama_folder(folder: Path) -> Path:
    """A small Llama (GQA, untied) saved by ``transformers`` into ``folder``."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=61, max_position_embeddings=16)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def gpt2_folder(folder: Path) -> Path:
    """A small GPT-2 (tied head, learned positions, biases) saved by ``transformers`` into ``folder``."""
    import transformers

    torch.manual_seed(1)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=61, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a misplaced one shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if ".ln_" in name else 0.0, 0.2)
    model.save_pretrained(folder)
    return folder


def layernorm_without_biases(folder: Path) -> Path:
    """A megazero checkpoint of a model with LayerNorm and no biases (SwiGLU, rotary, untied), random
    weights, in ``folder``: megatron-core's LayerNorm keeps a bias under ``--disable-bias-linear``,
    megazero's ``model.bias false`` has none."""
    from megazero.convert.targets import write_megazero

    torch.manual_seed(2)
    write_megazero(RandomSource(num_layers=2, hidden_size=32, vocab_size=61, seq_length=16, norm="layernorm",
                                activation="swiglu", position_embedding="rope", bias=False, tie_embeddings=False),
                   folder)
    return folder


def exact_gelu(folder: Path) -> Path:
    """A megazero checkpoint of a GPT-2-shaped model (learned positions, LayerNorm, biases, a tied head)
    whose GeLU is the exact one (``gelu_exact``), random weights, in ``folder``: megatron-core runs its
    fused bias-GeLU, the tanh one, unless ``bias_gelu_fusion`` is off."""
    from megazero.convert.targets import write_megazero

    torch.manual_seed(3)
    write_megazero(RandomSource(num_layers=2, hidden_size=32, vocab_size=61, seq_length=16, activation="gelu_exact"),
                   folder)
    return folder


class RandomSource:
    """A source with an architecture of our choosing and random weights."""

    kind = "test"

    def __init__(self, **fields):
        from megazero.convert.sources import logical_shapes

        self.cfg = ModelConfig(**{"num_layers": 1, "hidden_size": 16, "num_heads": 4, "vocab_size": 40,
                                  "seq_length": 8, **fields})
        self.shapes = logical_shapes(self.cfg)
        self.names = list(self.shapes)

    def read(self, name):
        shape = self.shapes[name]
        return torch.randn((self.cfg.vocab_size, *shape[1:]) if name.startswith(("embedding.tok", "lm_head")) else shape)
