"""Every bad input of `megazero convert` is one line naming the file or field, exit status 2, and
nothing at DST (no partial folder, no temporary folder left beside it)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

from megazero.checkpoint import latest_checkpoint
from megazero.cli import main
from megazero.convert.targets import write_megazero
from tests.convert_sources import RandomSource, fails, llama_folder, megatron_checkpoint


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """``hf``: a Llama folder saved by ``transformers``, and ``mz`` its import; ``gpt2``: a GPT-2
    folder exported by megazero (2 layers, tied head, vocab 40)."""
    root = tmp_path_factory.mktemp("bad")
    hf = llama_folder(root / "hf")
    assert main(["convert", str(hf), str(root / "mz")]) == 0
    write_megazero(RandomSource(num_layers=2), root / "gpt2_mz")
    assert main(["convert", str(root / "gpt2_mz"), str(root / "gpt2")]) == 0
    return root


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / src.name))


def _rank_file(root: Path) -> Path:
    return latest_checkpoint(root) / "rank_00000.safetensors"


@pytest.mark.parametrize("flags", [(), ("--no-verify",)])  # skipping the sha256 still checks presence and size
def test_missing_rank_file(sources, tmp_path, capsys, flags):
    mz = _copy(sources / "mz", tmp_path)
    _rank_file(mz).unlink()
    assert "rank_00000.safetensors: checkpoint file is missing" in fails(capsys, tmp_path, mz, *flags)


@pytest.mark.parametrize("flags", [(), ("--no-verify",)])
@pytest.mark.parametrize("grown", [False, True])
def test_a_rank_file_cut_or_grown(sources, tmp_path, capsys, flags, grown):
    """A size other than the record's is refused either way, without the sha256 too (planted: the size
    compared as at least the record's, which let --no-verify read a file with bytes appended)."""
    mz = _copy(sources / "mz", tmp_path)
    data = _rank_file(mz).read_bytes()
    _rank_file(mz).write_bytes(data + bytes(8) if grown else data[: len(data) // 2])
    assert "bytes but the checkpoint manifest records" in fails(capsys, tmp_path, mz, *flags)


def test_a_rank_file_that_does_not_parse_under_no_verify(sources, tmp_path, capsys):
    """Without the sha256, a rank file of the right size whose header is damaged is refused as the
    reader opens it, in one line naming it (planted: the reader's parse error swallowed, which
    converted uninitialised memory as the weights)."""
    mz = _copy(sources / "mz", tmp_path)
    data = bytearray(_rank_file(mz).read_bytes())
    data[:8] = (1 << 40).to_bytes(8, "little")  # a header longer than the file
    _rank_file(mz).write_bytes(bytes(data))
    assert f"{_rank_file(mz)}: not a safetensors file" in fails(capsys, tmp_path, mz, "--no-verify")


def test_no_verify_hashes_no_file(sources, tmp_path, monkeypatch):
    """--no-verify skips every file's sha256, the shard descriptions' too, as docs/checkpoints.md says
    (planted: the descriptions hashed whatever the flag)."""
    from megazero.checkpoint import format

    hashed, digest = [], format.file_digest
    monkeypatch.setattr(format, "file_digest", lambda f: hashed.append(Path(f.name).name) or digest(f))
    assert main(["convert", str(sources / "mz"), str(tmp_path / "out"), "--no-verify"]) == 0
    assert hashed == []


def test_checksum_mismatch(sources, tmp_path, capsys):
    mz = _copy(sources / "mz", tmp_path)
    data = bytearray(_rank_file(mz).read_bytes())
    data[-100] ^= 0xFF
    _rank_file(mz).write_bytes(bytes(data))
    assert "does not match the manifest" in fails(capsys, tmp_path, mz)


def test_missing_and_truncated_hf_shard(sources, tmp_path, capsys):
    hf = _copy(sources / "hf", tmp_path)
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    assert "model.safetensors: cannot be read" in fails(capsys, tmp_path, hf)
    weights.rename(hf / "model-00001-of-00002.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors",
                        "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    assert "model-00002-of-00002.safetensors: weight shard listed" in fails(capsys, tmp_path, hf)


def test_unknown_hf_architecture(sources, tmp_path, capsys):
    hf = _copy(sources / "hf", tmp_path)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "architectures": ["BertForMaskedLM"]}))
    assert "'BertForMaskedLM' is not one megazero can import" in fails(capsys, tmp_path, hf)


def test_hf_config_megazero_cannot_express(sources, tmp_path, capsys):
    hf = _copy(sources / "hf", tmp_path)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    assert "mlp_bias" in fails(capsys, tmp_path, hf)


@pytest.mark.parametrize("changes, expected", [
    ({"model_type": "mistral", "sliding_window": 8}, "model_type: 'mistral' is not LlamaForCausalLM's 'llama'"),
    ({"sliding_window": 8}, "sliding_window: 8 asks for sliding-window attention"),
    ({"use_sliding_window": True, "sliding_window": 8}, "sliding_window: 8 asks for sliding-window attention"),
    # compared with the context as text, each was a TypeError
    ({"sliding_window": "8"}, "sliding_window: expected an integer or null, got '8'"),
    ({"sliding_window": 8, "max_position_embeddings": "16"}, "max_position_embeddings: expected an integer or null"),
])
def test_hf_config_of_another_model_type_or_a_sliding_window(sources, tmp_path, capsys, changes, expected):
    """transformers builds what model_type names (a Mistral here, with its window), whatever the
    architectures list says; importing it as plain Llama would change the model without a word."""
    hf = _copy(sources / "hf", tmp_path)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, **changes}))
    assert expected in fails(capsys, tmp_path, hf)


@pytest.mark.parametrize("window", ["switched off", "as long as the context"])
def test_hf_config_with_a_window_that_does_not_apply_imports(sources, tmp_path, window):
    """Qwen2-style configs name a window and switch it off, others name one the context never
    exceeds: both are full attention, and refusing them would refuse models megazero computes."""
    hf = _copy(sources / "hf", tmp_path)
    config = json.loads((hf / "config.json").read_text())
    changes = ({"sliding_window": 8, "use_sliding_window": False} if window == "switched off"
               else {"sliding_window": config["max_position_embeddings"]})
    (hf / "config.json").write_text(json.dumps({**config, **changes}))
    assert main(["convert", str(hf), str(tmp_path / "mz")]) == 0


@pytest.mark.parametrize("fields,field", [
    ({"position_embedding": "rope", "norm": "layernorm", "activation": "swiglu"}, "model.norm"),
    ({"position_embedding": "rope", "norm": "rmsnorm", "activation": "gelu"}, "model.activation"),
    ({"position_embedding": "learned", "num_kv_heads": 2}, "model.num_kv_heads"),
])
def test_architecture_hf_cannot_express(tmp_path, capsys, fields, field):
    write_megazero(RandomSource(**fields), tmp_path / "mz")
    assert fails(capsys, tmp_path, tmp_path / "mz").startswith(f"megazero convert: error: {field}:")


def test_existing_dst_and_not_a_checkpoint(sources, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    capsys.readouterr()
    assert main(["convert", str(sources / "hf"), str(tmp_path / "taken")]) == 2
    assert "already exists" in capsys.readouterr().err and not any((tmp_path / "taken").iterdir())
    (tmp_path / "empty").mkdir()
    assert "not a megazero checkpoint" in fails(capsys, tmp_path, tmp_path / "empty")


def test_an_empty_src_or_dst_is_refused(sources, tmp_path, capsys):
    """An unset variable in a script gives "": read as the current directory, it was named "."."""
    assert fails(capsys, tmp_path, "").endswith("SRC: an empty path names no checkpoint (it would be read as the "
                                                 "current directory); give the checkpoint to convert")
    capsys.readouterr()
    assert main(["convert", str(sources / "hf"), ""]) == 2
    assert "DST: an empty path names no destination" in capsys.readouterr().err


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


def test_a_round_trip_through_hf_loads_into_the_model_it_came_from(sources, tmp_path, capsys):
    """megazero -> HF -> megazero records the MLP width the import read (4 h) where the source's config
    left it unset: training the source's model section from the round trip is the same model, not a
    "different model (model.ffn_hidden_size)"; another explicit width still is."""
    import numpy as np

    from data_pipeline.indexed import IndexedDatasetWriter
    from megazero.checkpoint import read_manifest
    from megazero.config.loader import config_to_dict

    assert main(["convert", str(sources / "gpt2"), str(tmp_path / "back")]) == 0
    model = config_to_dict(_config_of(read_manifest(latest_checkpoint(sources / "gpt2_mz"))))["model"]
    assert model["ffn_hidden_size"] is None
    with IndexedDatasetWriter(str(tmp_path / "tokens"), np.uint16) as writer:
        for start in range(1, 30):
            writer.add_document(np.arange(start, start + 10, dtype=np.uint16))
    args = [f"--model.{k}={json.dumps(v) if v is not None else 'null'}" for k, v in model.items() if k != "preset"]
    args += [f"--checkpoint.load={tmp_path / 'back'}", "--train.device=cpu", f"--logging.run_dir={tmp_path / 'run'}",
             f"--data.blend=[[1.0, {tmp_path / 'tokens'}]]", "--data.split=1", "--train.micro_batch_size=1",
             "--train.global_batch_size=1", "--train.train_steps=2"]
    capsys.readouterr()
    assert main(["train", "--check", *args]) == 0, capsys.readouterr().err
    assert main(["train", "--check", *args, "--model.ffn_hidden_size=32"]) == 2
    assert "different model (model.ffn_hidden_size)" in capsys.readouterr().err


def _config_of(manifest):
    from megazero.config.loader import build_dataclass
    from megazero.config.schema import Config

    return build_dataclass(Config, manifest["meta"]["config"], prefix="")


def _edit_config(hf: Path, **changes) -> None:
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, **changes}))


def _edit_weights(hf: Path, edit) -> None:
    """Rewrite ``model.safetensors`` with ``edit`` applied to its tensors (a dict, edited in place)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(hf / "model.safetensors")
    edit(tensors)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})


def _resize(name: str, rows: int):
    def edit(tensors):
        t = tensors[name]
        tensors[name] = torch.cat([t, torch.randn(max(rows - len(t), 0), *t.shape[1:])])[:rows].contiguous()
    return edit


# GPT-2 (exported by megazero: hidden 16, 4 heads, vocab 40, tied) and Llama (saved by transformers:
# hidden 32, 4 query and 2 key/value heads, ffn 64, vocab 61, untied): tensors whose shape config.json
# does not imply, vocabulary rows too few or too many included, name the tensor and both shapes.
@pytest.mark.parametrize("folder,name,rows,want", [
    ("gpt2", "transformer.wte.weight", 39, "[39, 16] where config.json implies [40, 16]"),
    ("gpt2", "transformer.wte.weight", 41, "[41, 16] where config.json implies [40, 16]"),
    ("gpt2", "transformer.wte.weight", 128, "[128, 16] where config.json implies [40, 16]"),
    ("gpt2", "transformer.wpe.weight", 7, "[7, 16] where config.json implies [8, 16]"),
    ("gpt2", "transformer.h.0.ln_1.weight", 15, "[15] where config.json implies [16]"),
    ("gpt2", "transformer.h.1.mlp.c_fc.weight", 15, "[15, 64] where config.json implies [16, 64]"),
    ("hf", "model.embed_tokens.weight", 60, "[60, 32] where config.json implies [61, 32]"),
    ("hf", "lm_head.weight", 64, "[64, 32] where config.json implies [61, 32]"),
    ("hf", "model.layers.1.self_attn.k_proj.weight", 32, "[32, 32] where config.json implies [16, 32]"),
    ("hf", "model.layers.0.mlp.gate_proj.weight", 63, "[63, 32] where config.json implies [64, 32]"),
    ("hf", "model.layers.0.input_layernorm.weight", 31, "[31] where config.json implies [32]"),
])
def test_hf_tensor_of_another_shape(sources, tmp_path, capsys, folder, name, rows, want):
    hf = _copy(sources / folder, tmp_path)
    _edit_weights(hf, _resize(name, rows))
    assert f"model.safetensors: tensor {name} has shape {want}" in fails(capsys, tmp_path, hf)


@pytest.mark.parametrize("folder,changes,want", [
    ("gpt2", {"n_layer": 1}, "does not use (transformer.h.1."),
    ("hf", {"num_hidden_layers": 1}, "does not use (model.layers.1."),
    ("hf", {"tie_word_embeddings": True}, "does not use (lm_head.weight)"),
    ("gpt2", {"n_layer": 3}, "has no tensor 'transformer.h.2."),
    ("gpt2", {"vocab_size": 48}, "transformer.wte.weight has shape [40, 16] where config.json implies [48, 16]"),
    ("gpt2", {"n_layer": -1}, "config.json: n_layer (model.num_layers): must be positive, got -1"),
    ("gpt2", {"n_layer": 0}, "config.json: n_layer (model.num_layers): must be positive, got 0"),
    ("gpt2", {"n_head": 3},
     "config.json: n_embd (model.hidden_size): 16 is not divisible by n_head (model.num_heads) 3"),
    ("gpt2", {"vocab_size": "40"}, "config.json: vocab_size: expected an integer, got '40'"),
    ("gpt2", {"layer_norm_epsilon": -1e-5}, "config.json: layer_norm_epsilon (model.norm_eps): must be positive"),
    ("hf", {"num_attention_heads": "4"}, "config.json: num_attention_heads: expected an integer, got '4'"),
    ("hf", {"num_key_value_heads": 3}, "config.json: num_key_value_heads (model.num_kv_heads): 3 must divide"),
    ("hf", {"tie_word_embeddings": "no"}, "config.json: tie_word_embeddings: expected true or false, got 'no'"),
    ("hf", {"head_dim": "8"}, "config.json: head_dim: expected an integer or null, got '8'"),
    ("hf", {"mlp_bias": 1}, "config.json: mlp_bias: expected true or false, got 1"),
    ("hf", {"rope_parameters": 5}, "config.json: rope_parameters: expected a mapping, got 5"),
    ("hf", {"rope_parameters": {"rope_type": "default", "rope_theta": "fast"}}, "rope_theta: expected a number"),
])
def test_hf_config_the_weights_do_not_match(sources, tmp_path, capsys, folder, changes, want):
    hf = _copy(sources / folder, tmp_path)
    _edit_config(hf, **changes)
    assert want in fails(capsys, tmp_path, hf)


def test_hf_config_incomplete_or_not_a_mapping(sources, tmp_path, capsys):
    hf = _copy(sources / "gpt2", tmp_path)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "n_embd"}))
    assert "config.json: has no 'n_embd' field, which GPT2LMHeadModel needs" in fails(capsys, tmp_path, hf)
    (hf / "config.json").write_text("[]")
    assert "config.json: holds a list, not a mapping of fields" in fails(capsys, tmp_path, hf)


def test_hf_index_and_config_that_do_not_hold_what_they_claim(sources, tmp_path, capsys):
    """A shard holding a tensor its index leaves out (a head beside a tied config) was converted without
    it; a weight_map or architectures of the wrong shape was a traceback; a rope_scaling beside a
    default rope_parameters was imported as plain rotary, where transformers reads the scaling."""
    from safetensors.torch import load_file

    hf = _copy(sources / "hf", tmp_path)
    names = [n for n in load_file(hf / "model.safetensors") if n != "lm_head.weight"]
    index = hf / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {n: "model.safetensors" for n in names}}))
    assert ("model.safetensors: holds tensor 'lm_head.weight', which model.safetensors.index.json does not list in "
            "it; the index does not match its shards") in fails(capsys, tmp_path, hf)
    for weight_map in ([], {"lm_head.weight": None}):
        index.write_text(json.dumps({"weight_map": weight_map}))
        assert "weight_map is not a mapping of tensor names to shard files" in fails(capsys, tmp_path, hf)
    index.write_text("[]")
    assert "model.safetensors.index.json: is not a safetensors index (TypeError" in fails(capsys, tmp_path, hf)
    index.unlink()
    _edit_config(hf, architectures="LlamaForCausalLM")
    assert "architectures is 'LlamaForCausalLM', not a list of class names" in fails(capsys, tmp_path, hf)
    _edit_config(hf, architectures=["LlamaForCausalLM"], rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                 rope_scaling={"type": "linear", "factor": 2.0})
    assert "rope_scaling: 'linear' has no counterpart" in fails(capsys, tmp_path, hf)


def test_outputs_that_would_lose_or_damage_something(sources, tmp_path, capsys):
    """An fp16 export of a value past 65,504 was written as inf; a DST inside SRC wrote a folder into
    the checkpoint a run resumes from."""
    from megazero.convert.targets import write_megazero

    write_megazero(RandomSource(num_layers=1), tmp_path / "mz")
    step = latest_checkpoint(tmp_path / "mz")
    big = RandomSource(num_layers=1)
    read = big.read
    big.read = lambda name: read(name) * (1e6 if name == "final_norm.weight" else 1.0)
    write_megazero(big, tmp_path / "big")
    err = fails(capsys, tmp_path, tmp_path / "big", "--dtype", "fp16")
    assert re.search(r"transformer\.ln_f\.weight: holds values up to [\d.e+]+, beyond what float16 can hold \(they "
                     r"would be written as inf\)", err), err
    assert main(["convert", str(tmp_path / "big"), str(tmp_path / "bf"), "--dtype", "bf16"]) == 0
    assert "inside SRC" in fails(capsys, tmp_path, tmp_path / "mz", dst=step.parent / "step_0000099")


@pytest.mark.parametrize("src,to", [("gpt2_mz", "hf"), ("gpt2_mz", "torch"), ("hf", "megazero")])
def test_a_full_disk_is_one_line_naming_dst(sources, tmp_path, capsys, monkeypatch, src, to):
    """A destination that fills up mid-tensor was a traceback ending in ``OSError: [Errno 28]``."""
    import errno

    from megazero.checkpoint.format import HashingWriter

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(HashingWriter, "write", full)
    dst = tmp_path / ("out.safetensors" if to == "torch" else "out")
    err = fails(capsys, tmp_path, sources / src, "--to", to, dst=dst)
    assert err.endswith(f"error: {dst}: cannot be written (No space left on device); free space beside it or give "
                        "a DST on another disk"), err


def test_hf_missing_or_non_float_tensor(sources, tmp_path, capsys):
    hf = _copy(sources / "hf", tmp_path)
    _edit_weights(hf, lambda tensors: tensors.pop("model.norm.weight"))
    assert "has no tensor 'model.norm.weight' (1 missing in all)" in fails(capsys, tmp_path, hf)
    _edit_weights(hf, lambda tensors: tensors.update({"model.norm.weight": torch.ones(32, dtype=torch.int8)}))
    assert "tensor model.norm.weight is I8, not a float type" in fails(capsys, tmp_path, hf)


@pytest.mark.parametrize("folder,buffer", [("gpt2", "transformer.h.1.attn.bias"),
                                           ("hf", "model.layers.0.self_attn.rotary_emb.inv_freq")])
def test_hf_buffers_without_weights_are_skipped(sources, tmp_path, folder, buffer):
    """Older ``transformers`` saved buffers (GPT-2's causal mask, Llama's rotary frequencies) beside
    the weights; they carry nothing to import, so they are not refused as unused tensors."""
    hf = _copy(sources / folder, tmp_path)
    _edit_weights(hf, lambda tensors: tensors.update({buffer: torch.ones(4)}))
    assert main(["convert", str(hf), str(tmp_path / "out")]) == 0


@pytest.mark.parametrize("flags,want", [
    (["--to", "megazero", "--dp", "-1"], "--dp: must be 1 or more, got -1"),
    (["--to", "megazero", "--dp", "0"], "--dp: must be 1 or more, got 0"),
    (["--to", "megazero", "--tp", "0"], "--tp: must be 1 or more, got 0"),
    (["--to", "megazero", "--pp", "-2"], "--pp: must be 1 or more, got -2"),
    (["--to", "megazero", "--virtual-stages", "0"], "--virtual-stages: must be 1 or more, got 0"),
    (["--shard-size-gb", "nan"], "--shard-size-gb: must be a positive number of GB, got nan"),
    (["--shard-size-gb", "inf"], "--shard-size-gb: must be a positive number of GB, got inf"),
    (["--shard-size-gb", "0"], "--shard-size-gb: must be a positive number of GB, got 0.0"),
    (["--shard-size-gb", "-1"], "--shard-size-gb: must be a positive number of GB, got -1.0"),
    (["--vocab-size", "0"], "--vocab-size: must be 1 or more, got 0"),
])
def test_bad_numeric_flags(sources, tmp_path, capsys, flags, want):
    assert fails(capsys, tmp_path, sources / "gpt2_mz", *flags).endswith(f"error: {want}")


@pytest.mark.parametrize("to,dst,flags", [("torch", "model.safetensors", ["--tp", "2"]),
                                           ("hf", "out", ["--pp", "2", "--pipeline-schedule", "zb-v"])])
def test_layout_flags_apply_to_a_megazero_target_only(sources, tmp_path, capsys, to, dst, flags):
    """A run's layout means nothing to a state dict or an HF folder: the flags are refused, naming them,
    rather than ignored. (Planted: refused for ``--to hf`` only, so ``--to torch --tp 2`` wrote a whole
    state dict as if no flag had been given.)"""
    err = fails(capsys, tmp_path, sources / "gpt2_mz", "--to", to, *flags, dst=tmp_path / dst)
    names = ", ".join(flag for flag in flags if flag.startswith("--"))
    also = " (and --tp, --pp to --to megatron)" if set(names.split(", ")) <= {"--tp", "--pp"} else ""
    assert err.endswith(f"{names}: apply to --to megazero only{also}"), err


@pytest.mark.parametrize("src,to", [("hf", "megazero"), ("gpt2_mz", "torch")])
def test_reset_step_applies_to_a_megazero_reshard_only(sources, tmp_path, capsys, src, to):
    """An HF folder always starts at step 0 and a state dict has no step: --reset-step is refused
    there rather than taken as done."""
    dst = tmp_path / ("out.safetensors" if to == "torch" else "out")
    err = fails(capsys, tmp_path, sources / src, "--to", to, "--reset-step", dst=dst)
    assert err.endswith("--reset-step: applies to --to megazero from a megazero checkpoint only (other sources "
                        "always start at step 0)"), err


@pytest.mark.parametrize("name", ["model", "model.pt"])
def test_a_state_dict_file_must_be_named_safetensors(sources, tmp_path, capsys, name):
    """``--to torch`` writes safetensors; a file named ``model.pt`` would be taken for a pickle."""
    err = fails(capsys, tmp_path, sources / "gpt2_mz", "--to", "torch", dst=tmp_path / name)
    assert err.endswith(f"{tmp_path / name}: --to torch writes one safetensors file; name it NAME.safetensors"), err


def test_a_tokenizer_bigger_than_the_model_is_refused(sources, tmp_path, capsys):
    """A tokenizer with more tokens than the model's rows would make an HF folder that encodes text to
    ids the model cannot embed (``mz`` has 61 rows)."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"w{i}": i for i in range(99)} | {"</s>": 99}, unk_token="</s>")).save(
        str(tmp_path / "big.json"))
    err = fails(capsys, tmp_path, sources / "mz", "--to", "hf", "--tokenizer", tmp_path / "big.json")
    assert err.endswith(f"--tokenizer {tmp_path / 'big.json'}: has 100 tokens, but the model has 61; give the "
                        "tokenizer the model was trained with"), err


@pytest.mark.parametrize("folder, tied", [("gpt2", True), ("hf", False)], ids=["gpt2", "llama"])
def test_a_config_without_tie_word_embeddings_takes_the_architectures_default(sources, tmp_path, folder, tied):
    """The hub's GPT-2 config.json has no tie_word_embeddings (transformers ties by default); Llama's
    default is untied. The import must read a missing key as transformers does."""
    from megazero.checkpoint import read_manifest

    src = _copy(sources / folder, tmp_path)
    config = json.loads((src / "config.json").read_text())
    config.pop("tie_word_embeddings", None)
    (src / "config.json").write_text(json.dumps(config))
    assert main(["convert", str(src), str(tmp_path / "out")]) == 0
    model = read_manifest(latest_checkpoint(tmp_path / "out"))["meta"]["config"]["model"]
    assert model["tie_embeddings"] is tied


def test_dropout_rates_keep_their_roles_through_hf_and_megatron(tmp_path):
    """The residual and attention dropouts have separate keys in every format: exported to GPT-2 and
    imported from Megatron, neither takes the other's rate."""
    from megazero.checkpoint import read_manifest

    write_megazero(RandomSource(num_layers=1, dropout=0.1, attention_dropout=0.2), tmp_path / "mz")
    assert main(["convert", str(tmp_path / "mz"), str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["resid_pdrop"], config["embd_pdrop"], config["attn_pdrop"]) == (0.1, 0.1, 0.2), config
    assert main(["convert", str(megatron_checkpoint(tmp_path / "meg", hidden_dropout=0.1, attention_dropout=0.05)),
                 str(tmp_path / "from-meg")]) == 0
    model = read_manifest(latest_checkpoint(tmp_path / "from-meg"))["meta"]["config"]["model"]
    assert (model["dropout"], model["attention_dropout"]) == (0.1, 0.05), model


def test_an_hf_folder_with_two_sets_of_weights_is_refused(sources, tmp_path, capsys):
    """transformers loads model.safetensors and ignores an index beside it; we read the index: which
    weights a conversion took would depend on the tool."""
    hf = _copy(sources / "hf", tmp_path)
    shutil.copyfile(hf / "model.safetensors", hf / "model-00001-of-00001.safetensors")
    names = json.loads(json.dumps(list(_header_names(hf / "model.safetensors"))))
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}))
    assert "holds both model.safetensors and model.safetensors.index.json" in fails(capsys, tmp_path, hf)


def _header_names(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return list(f.keys())


def test_an_hf_config_without_architectures_is_read_by_model_type(sources, tmp_path):
    """What ``LlamaConfig().save_pretrained`` writes; transformers builds it from model_type."""
    hf = _copy(sources / "hf", tmp_path)
    config = json.loads((hf / "config.json").read_text())
    del config["architectures"]
    (hf / "config.json").write_text(json.dumps(config))
    assert main(["convert", str(hf), str(tmp_path / "out")]) == 0


def test_paths_that_are_not_what_convert_needs(sources, tmp_path, capsys):
    """A file as SRC (the state dict --to torch writes) was a NotADirectoryError; a dangling link
    as DST failed at the final rename, after the whole conversion; a DST under a file named a
    training setting (or, a folder further up, a bare errno after the source was read)."""
    assert main(["convert", str(sources / "gpt2_mz"), str(tmp_path / "sd.safetensors"), "--to", "torch"]) == 0
    err = fails(capsys, tmp_path, tmp_path / "sd.safetensors")
    assert err.endswith(f"{tmp_path / 'sd.safetensors'}: is a file; SRC is a checkpoint folder (a state dict written "
                        "by --to torch is for other tools and is not converted back)"), err
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    capsys.readouterr()
    assert main(["convert", str(sources / "gpt2_mz"), str(tmp_path / "link")]) == 2
    assert "link: already exists" in capsys.readouterr().err and not (tmp_path / "nowhere").exists()
    (tmp_path / "afile").write_text("x")
    for dst in (tmp_path / "afile" / "out", tmp_path / "afile" / "sub" / "out"):  # a parent or one above it
        err = fails(capsys, tmp_path, sources / "gpt2_mz", dst=dst)
        assert err.endswith(f"{dst}: {tmp_path / 'afile'} is a file, not a folder; give another DST path"), err


def test_a_tokenizer_transformers_cannot_take_is_refused_before_any_weight(sources, tmp_path, capsys, monkeypatch):
    """A SentencePiece char model was refused only after every weight shard had been written."""
    import sentencepiece as spm

    from megazero.convert import hf

    (tmp_path / "text.txt").write_text("".join(f"{'abcdefgh'[i % 8] * (i % 5 + 1)} abc\n" for i in range(200)))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "text.txt"), model_prefix=str(tmp_path / "char"),
                                   vocab_size=20, model_type="char", eos_id=2, pad_id=3, hard_vocab_limit=False)
    monkeypatch.setattr(hf, "write_hf", lambda *a, **k: pytest.fail("weights written before the tokenizer check"))
    err = fails(capsys, tmp_path, sources / "mz", "--to", "hf", "--tokenizer", tmp_path / "char.model")
    assert "a SentencePiece CHAR model cannot be written for transformers" in err, err


@pytest.mark.parametrize("changes,want", [
    ({"scale_attn_by_inverse_layer_idx": True}, "config.json: scale_attn_by_inverse_layer_idx: True has no "
                                                "counterpart in megazero's GPT"),
    ({"scale_attn_weights": False}, "config.json: scale_attn_weights: False has no counterpart"),
    ({"add_cross_attention": True}, "config.json: add_cross_attention: True has no counterpart"),
    ({"activation_function": "relu"}, "config.json: activation_function: 'relu' is not a GeLU megazero computes; "
                                      "only gelu_new / gelu_pytorch_tanh (the tanh approximation) and gelu (exact)"),
])
def test_gpt2_attention_switches_without_counterpart(sources, tmp_path, capsys, changes, want):
    hf = _copy(sources / "gpt2", tmp_path)
    _edit_config(hf, **changes)
    assert want in fails(capsys, tmp_path, hf)


class _Diverged(RandomSource):
    """A source whose first block's query-key-value weight holds a NaN and an infinity."""

    def read(self, name):
        t = super().read(name)
        if name.startswith("layers.0.") and name.endswith("weight") and t.dim() == 2:
            t[0, 0], t[-1, -1] = float("nan"), float("inf")
        return t


@pytest.mark.parametrize("value", [float("nan"), float("-inf")])
def test_weights_that_are_not_finite_are_refused(sources, tmp_path, capsys, value):
    """A NaN or an infinity in a weight is one line naming the file and tensor, from each source kind
    (Hugging Face, Megatron, megazero), with nothing written: a model started from it computes NaN
    from its first token. (Planted: the check left out of each source's read, and of a megazero
    source's optimizer state.)"""
    hf = _copy(sources / "hf", tmp_path)

    def poison(tensors):
        tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = value
    _edit_weights(hf, poison)
    err = fails(capsys, tmp_path, hf)
    assert "model.safetensors: tensor model.layers.1.mlp.up_proj.weight: holds 1 NaN or infinite values" in err, err

    root = megatron_checkpoint(tmp_path / "meg")
    path = root / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["model"]["decoder.layers.1.mlp.linear_fc2.weight"][0, 0] = value
    torch.save(state, path)
    err = fails(capsys, tmp_path, root, dst=tmp_path / "out_meg")
    assert f"{path}: decoder.layers.1.mlp.linear_fc2.weight: holds 1 NaN" in err, err

    write_megazero(_Diverged(num_layers=2), tmp_path / "mz")
    err = fails(capsys, tmp_path, tmp_path / "mz", dst=tmp_path / "out_mz")
    assert "parameter 'layers.0." in err and "holds 2 NaN or infinite values" in err, err
    # megazero to megazero carries the optimizer's state too, each tensor checked
    err = fails(capsys, tmp_path, tmp_path / "mz", "--to", "megazero", dst=tmp_path / "out_mz2")
    assert "parameter 'layers.0." in err and "(master): holds 2 NaN or infinite values" in err, err
