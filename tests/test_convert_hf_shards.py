"""How an export splits its tensors into safetensors files: consecutive tensors up to the shard size
a file, a shard exactly full kept whole, a tensor larger than the size alone in its own file, and
files numbered 1 to n with none empty."""

from __future__ import annotations

import torch

from megazero.convert.hf import _plan_shards


def test_tensors_that_exactly_fill_a_shard_stay_in_one_file():
    """40 + 60 bytes of fp32 fill a 100-byte shard exactly: one model.safetensors, not two files."""
    assert _plan_shards({"a": (10,), "b": (15,)}, torch.float32, 100) == \
        {"a": "model.safetensors", "b": "model.safetensors"}


def test_a_tensor_larger_than_a_shard_is_alone_and_numbering_has_no_gap():
    """The first tensor (120 bytes) exceeds the 100-byte shard: it is file 1 of 3, with no empty file
    before it; the next two (40 + 80 bytes) do not fit together."""
    planned = _plan_shards({"big": (30,), "a": (10,), "b": (20,)}, torch.float32, 100)
    assert planned == {"big": "model-00001-of-00003.safetensors", "a": "model-00002-of-00003.safetensors",
                       "b": "model-00003-of-00003.safetensors"}


def test_a_shard_size_counts_the_dtype_bytes():
    """In bf16 the same tensors take half the bytes: 20 + 30 + 20 bytes fit two 50-byte shards."""
    planned = _plan_shards({"a": (10,), "b": (15,), "c": (10,)}, torch.bfloat16, 50)
    assert planned == {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                       "c": "model-00002-of-00002.safetensors"}


def test_shard_size_gb_counts_decimal_gigabytes(tmp_path):
    """--shard-size-gb 0.0000082 is 8,200 bytes (GB, as Hugging Face's max_shard_size counts them, not
    GiB: 8,804). The one-layer GPT-2's fp32 tensors then fill three files, of 7,680 bytes (embeddings,
    first norm, attention, second norm), 4,352 (c_fc) and 4,288 (the MLP's c_proj and the final norm)."""
    import json

    from safetensors.torch import load_file

    from megazero.cli import main
    from megazero.convert.targets import write_megazero
    from tests.convert_sources import RandomSource

    write_megazero(RandomSource(num_layers=1), tmp_path / "mz")
    assert main(["convert", str(tmp_path / "mz"), str(tmp_path / "hf"), "--shard-size-gb", "0.0000082"]) == 0
    files = sorted(set(json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"].values()))
    sizes = [sum(t.numel() * t.element_size() for t in load_file(tmp_path / "hf" / f).values()) for f in files]
    assert sizes == [7680, 4352, 4288]
