"""The tensors of a Hugging Face folder are checked whole before anything is converted: every
dimension of every shape, and a float dtype megazero can read as the weights they are."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
from safetensors.torch import load_file, save_file

from tests.convert_sources import fails, llama_folder


@pytest.fixture
def llama(tmp_path):
    """A Llama folder (hidden 32, 4 query and 2 key/value heads, ffn 64, vocab 61) and a way to
    replace one of its tensors."""
    folder = llama_folder(tmp_path / "llama")

    def replace(name: str, tensor: torch.Tensor) -> None:
        tensors = load_file(folder / "model.safetensors")
        tensors[name] = tensor
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})

    return folder, replace


@pytest.mark.parametrize("name, shape, implied", [
    ("model.layers.0.mlp.down_proj.weight", (32, 63), [32, 64]),
    ("model.embed_tokens.weight", (61, 31), [61, 32]),
    ("model.layers.1.self_attn.o_proj.weight", (32, 16), [32, 32]),
])
def test_a_tensor_of_other_columns_is_refused(llama, tmp_path, capsys, name, shape, implied):
    """The rows are right and a later dimension is not: still refused, naming the tensor and both
    shapes, not a traceback from deep inside the conversion."""
    folder, replace = llama
    replace(name, torch.randn(shape))
    err = fails(capsys, tmp_path, folder)
    assert f"tensor {name} has shape {list(shape)} where config.json implies {implied}" in err, err


@pytest.mark.parametrize("dtype, name", [(torch.int32, "I32"), (torch.uint8, "U8"), (torch.bool, "BOOL"),
                                         (torch.float8_e4m3fn, "F8_E4M3")])
def test_a_tensor_that_is_not_one_of_the_float_types_read_is_refused(llama, tmp_path, capsys, dtype, name):
    """Packed quantized weights (int32, uint8) or fp8 ones read as floats would be a model of
    other weights; refused with the dtype named."""
    folder, replace = llama
    replace("model.layers.0.self_attn.q_proj.weight", torch.ones(32, 32).to(dtype))
    err = fails(capsys, tmp_path, folder)
    assert f"tensor model.layers.0.self_attn.q_proj.weight is {name}, not a float type (F16, BF16, F32, F64)" in err


def test_a_tensor_in_a_shard_the_index_assigns_to_another_is_refused(llama, tmp_path, capsys):
    """Two shards that both hold model.norm.weight, with other values, and an index naming the second:
    which copy is the model's is unknown, so the folder is refused naming the shard that holds the
    extra copy (a tensor the index lists elsewhere is no more trustworthy than one it does not list)."""
    import json

    folder, _ = llama
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    first = {name: t for name, t in tensors.items() if name.startswith(("model.embed_tokens", "model.layers.0."))}
    second = {name: t for name, t in tensors.items() if name not in first}
    files = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    save_file({**first, "model.norm.weight": torch.full((32,), 2.0)}, folder / files[0], metadata={"format": "pt"})
    save_file(second, folder / files[1], metadata={"format": "pt"})
    weight_map = {**{name: files[0] for name in first}, **{name: files[1] for name in second}}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    err = fails(capsys, tmp_path, folder)
    assert err.endswith(f"{folder / files[0]}: holds tensor 'model.norm.weight', which model.safetensors.index.json "
                        "does not list in it; the index does not match its shards -- restore it"), err
