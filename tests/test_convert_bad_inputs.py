"""Every bad input of `megazero convert` is one line naming the file or field, exit status 2, and
nothing at DST (no partial folder, no temporary folder left beside it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

from megazero.checkpoint import latest_checkpoint
from megazero.cli import main
from megazero.convert.targets import write_megazero
from models.config import ModelConfig


def _llama(folder: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=61, max_position_embeddings=16)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    hf = _llama(root / "hf")
    assert main(["convert", str(hf), str(root / "mz")]) == 0
    return root


def _fails(capsys, tmp_path, *args, dst=None) -> str:
    dst = dst or tmp_path / "out"
    capsys.readouterr()
    assert main(["convert", *map(str, args), str(dst)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not dst.exists() and not list(dst.parent.glob(f".{dst.name}.*")), list(dst.parent.iterdir())
    return err


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / src.name))


def _rank_file(root: Path) -> Path:
    return latest_checkpoint(root) / "rank_00000.safetensors"


def test_missing_rank_file(sources, tmp_path, capsys):
    mz = _copy(sources / "mz", tmp_path)
    _rank_file(mz).unlink()
    assert "rank_00000.safetensors: checkpoint file is missing" in _fails(capsys, tmp_path, mz)


def test_truncated_rank_file(sources, tmp_path, capsys):
    mz = _copy(sources / "mz", tmp_path)
    data = _rank_file(mz).read_bytes()
    _rank_file(mz).write_bytes(data[: len(data) // 2])
    assert "truncated" in _fails(capsys, tmp_path, mz)


def test_checksum_mismatch(sources, tmp_path, capsys):
    mz = _copy(sources / "mz", tmp_path)
    data = bytearray(_rank_file(mz).read_bytes())
    data[-100] ^= 0xFF
    _rank_file(mz).write_bytes(bytes(data))
    assert "does not match the manifest" in _fails(capsys, tmp_path, mz)


def test_missing_and_truncated_hf_shard(sources, tmp_path, capsys):
    hf = _copy(sources / "hf", tmp_path)
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    assert "model.safetensors: cannot be read" in _fails(capsys, tmp_path, hf)
    weights.rename(hf / "model-00001-of-00002.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors",
                        "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    assert "model-00002-of-00002.safetensors: weight shard listed" in _fails(capsys, tmp_path, hf)


def test_unknown_hf_architecture(sources, tmp_path, capsys):
    hf = _copy(sources / "hf", tmp_path)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "architectures": ["BertForMaskedLM"]}))
    assert "'BertForMaskedLM' is not one megazero can import" in _fails(capsys, tmp_path, hf)


def test_hf_config_megazero_cannot_express(sources, tmp_path, capsys):
    hf = _copy(sources / "hf", tmp_path)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    assert "mlp_bias" in _fails(capsys, tmp_path, hf)


class _Random:
    """A source with an architecture of our choosing and random weights."""

    kind = "test"

    def __init__(self, **fields):
        from megazero.convert.sources import logical_shapes

        self.cfg = ModelConfig(num_layers=1, hidden_size=16, num_heads=4, vocab_size=40, seq_length=8, **fields)
        self.shapes = logical_shapes(self.cfg)
        self.names = list(self.shapes)

    def read(self, name):
        shape = self.shapes[name]
        return torch.randn((self.cfg.vocab_size, *shape[1:]) if name.startswith(("embedding.tok", "lm_head")) else shape)


@pytest.mark.parametrize("fields,field", [
    ({"position_embedding": "rope", "norm": "layernorm", "activation": "swiglu"}, "model.norm"),
    ({"position_embedding": "rope", "norm": "rmsnorm", "activation": "gelu"}, "model.activation"),
    ({"position_embedding": "learned", "num_kv_heads": 2}, "model.num_kv_heads"),
])
def test_architecture_hf_cannot_express(tmp_path, capsys, fields, field):
    write_megazero(_Random(**fields), tmp_path / "mz")
    assert _fails(capsys, tmp_path, tmp_path / "mz").startswith(f"megazero convert: error: {field}:")


def test_existing_dst_and_not_a_checkpoint(sources, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    capsys.readouterr()
    assert main(["convert", str(sources / "hf"), str(tmp_path / "taken")]) == 2
    assert "already exists" in capsys.readouterr().err and not any((tmp_path / "taken").iterdir())
    (tmp_path / "empty").mkdir()
    assert "not a megazero checkpoint" in _fails(capsys, tmp_path, tmp_path / "empty")


@pytest.mark.parametrize("override,field", [("--model.hidden_size=64", "model.hidden_size"),
                                            ("--parallel.tp=3", "model.num_heads")])
def test_training_refuses_a_converted_checkpoint_it_cannot_take(sources, tmp_path, capsys, override, field):
    """The converted checkpoint records its model: a run with another model section, or a tp that
    does not divide the heads, is refused before launch, in one line naming the field."""
    from megazero.checkpoint import read_manifest
    from megazero.config.loader import config_to_dict

    model = config_to_dict(_config_of(read_manifest(latest_checkpoint(sources / "mz"))))["model"]
    args = [f"--model.{k}={json.dumps(v) if v is not None else 'null'}" for k, v in model.items() if k != "preset"]
    capsys.readouterr()
    code = main(["train", "--check", *args, f"--checkpoint.load={sources / 'mz'}", "--train.device=cpu",
                 f"--logging.run_dir={tmp_path / 'run'}", override])
    err = capsys.readouterr().err
    assert code == 2 and field in err, err


def _config_of(manifest):
    from megazero.config.loader import build_dataclass
    from megazero.config.schema import Config

    return build_dataclass(Config, manifest["meta"]["config"], prefix="")
