"""Megatron imports at their edges: tp copies of a replicated tensor that differ by a rounding's
worth are still named, a --vocab-size of exactly the padded rows is taken, and the args an export
records import back to the model section it was written from."""

from __future__ import annotations

import argparse

import pytest
import torch

from megazero.cli import main
from megazero.convert.megatron import _vocab_size
from megazero.convert.megatron_out import write_megatron
from tests.convert_sources import RandomSource


def test_tp_copies_that_differ_by_a_little_are_named(tmp_path, capsys):
    """Any difference between the tp copies of a replicated tensor means Megatron's ranks computed
    with different weights: one of 1e-4 (a bf16 drift) is named like a large one."""
    write_megatron(RandomSource(num_layers=2, hidden_size=16, num_heads=4), tmp_path / "meg", tp=2, pp=1,
                   impl="local")
    for rank, value in enumerate((0.0, 1e-4)):  # a difference of 1e-4 exactly, whatever the random weights
        path = tmp_path / "meg" / "release" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt"
        state = torch.load(path, weights_only=False)
        state["model"]["decoder.final_layernorm.weight"][3] = value
        torch.save(state, path)
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "meg"), str(tmp_path / "mz")]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "different copies" in line]
    assert len(notes) == 1 and "decoder.final_layernorm.weight (largest difference 0.0001)" in notes[0], notes


def test_a_vocab_size_of_exactly_the_padded_rows_is_taken():
    """--vocab-size may name every padded row (a tokenizer of 128 pieces for 128 rows): refused only
    beyond them."""
    args = argparse.Namespace(padded_vocab_size=128, tensor_model_parallel_size=1)
    assert _vocab_size(args, "ckpt", 128) == 128


def test_layers_that_do_not_split_evenly_over_the_stages_are_refused(tmp_path):
    """Megatron-LM gives every stage num_layers / pp layers: 3 layers over 2 stages would be written
    as one a stage, the third left out, so the export is refused naming --pp."""
    from megazero.errors import UserError

    with pytest.raises(UserError, match="--pp 2: the model's 3 layers do not split evenly over 2 stages"):
        write_megatron(RandomSource(num_layers=3), tmp_path / "meg", tp=1, pp=2, impl="local")
    assert not (tmp_path / "meg").exists()


@pytest.mark.parametrize("fields", [
    {"norm_eps": 1e-3, "seq_length": 12, "dropout": 0.25, "attention_dropout": 0.125, "tie_embeddings": False},
    {"position_embedding": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "num_kv_heads": 2,
     "rope_theta": 500.0, "norm_eps": 1e-3, "seq_length": 12, "tie_embeddings": True},
], ids=["gpt2", "llama"])
def test_a_megatron_export_imports_back_to_the_model_section_it_was_written_from(tmp_path, fields):
    """The args an export records give back every field of the model it was written from, each away
    from Megatron's default: an epsilon or rotary base recorded as the default would have Megatron-LM
    (or a later import) run another model with the right weights (planted: norm_epsilon and
    rotary_base written as defaults, rotary_base not read)."""
    from megazero.convert.megatron import MegatronSource

    source = RandomSource(num_layers=2, **fields)
    write_megatron(source, tmp_path / "meg", tp=2, pp=1, impl="local")
    back = MegatronSource(tmp_path / "meg").cfg
    for field in ("num_layers", "hidden_size", "num_heads", "kv_heads", "ffn_size", "vocab_size", *fields):
        assert getattr(back, field) == getattr(source.cfg, field), field
