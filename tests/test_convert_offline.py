"""Export and offline-reshard promises the multi-rank worlds of ``tests/test_convert_hf.py`` do not
reach, each on one process in a few seconds. Planted bugs these catch: ``torch_dtype`` recorded as float32 for a bf16
export; a bf16 Hugging Face folder refused as "not a float type"; the offline reshard dropping the
consumed samples, the loss-scaler state, the ``latest`` pointer or the tokenizer record;
``--reset-step`` ignored; the ``--to torch`` file written without its model config; the Adam step
taken as the smallest over ranks (a rank whose shard is all padding saves 0); ``initializer_range``
written as the default std where ``model.init_std`` is set, or ignored on import; a bf16 index's ``total_size`` counted at
4 bytes an element.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

from megazero.checkpoint import latest_checkpoint
from megazero.checkpoint.reader import STATE_KEYS, CheckpointReader
from megazero.cli import main
from megazero.convert.targets import write_megazero
from tests.convert_sources import RandomSource


def convert(*args) -> int:
    return main(["convert", *map(str, args)])


def test_a_bf16_export_says_so_and_a_bf16_folder_imports(tmp_path):
    """--dtype bf16 writes bf16 tensors and a config.json whose torch_dtype says bfloat16 (what
    ``dtype="auto"`` loads); such a folder, the usual published kind, imports to the same values."""
    from safetensors import safe_open

    from megazero.generate import load_model

    torch.manual_seed(0)
    write_megazero(RandomSource(num_layers=2, position_embedding="rope", norm="rmsnorm", activation="swiglu",
                           tie_embeddings=False), tmp_path / "mz")
    assert convert(tmp_path / "mz", tmp_path / "hf", "--dtype", "bf16") == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118 - not a dict
        embedding = f.get_tensor("model.embed_tokens.weight")
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")
    assert auto.model.embed_tokens.weight.dtype == torch.bfloat16
    assert convert(tmp_path / "hf", tmp_path / "back") == 0
    back, _ = load_model(tmp_path / "back")
    assert torch.equal(back.embedding.tokens.weight[:embedding.shape[0]], embedding.float())



@pytest.mark.parametrize("init_std", [0.05, None], ids=["set", "default"])
def test_initializer_range_is_the_init_std(tmp_path, init_std):
    """config.json's initializer_range (the std transformers initialises new weights with, a resized
    embedding's rows for one) is the std megazero initialises with: ``model.init_std``, or its
    default 1/sqrt(3 hidden) (planted: the default written where init_std is set). Imported back,
    it is the std set, or unset where it was unset (not pinned to this width)."""
    from megazero.checkpoint import read_manifest

    source = RandomSource(num_layers=1, init_std=init_std)
    write_megazero(source, tmp_path / "mz")
    assert convert(tmp_path / "mz", tmp_path / "hf") == 0
    ours = source.cfg.effective_init_std
    assert ours == (init_std or 1 / math.sqrt(3 * source.cfg.hidden_size))
    written = json.loads((tmp_path / "hf" / "config.json").read_text())["initializer_range"]
    assert written == ours, (written, ours)
    assert transformers.AutoConfig.from_pretrained(tmp_path / "hf").initializer_range == written
    assert convert(tmp_path / "hf", tmp_path / "back") == 0
    back = read_manifest(latest_checkpoint(tmp_path / "back"))["meta"]["config"]["model"]
    assert back["init_std"] == init_std


@pytest.mark.parametrize("initializer_range,init_std", [(0.01, 0.01), (1 / math.sqrt(3 * 32), None), (None, 0.02)],
                         ids=["set", "derived", "absent"])
def test_initializer_range_imports_as_the_init_std(tmp_path, initializer_range, init_std):
    """A folder's initializer_range is its model.init_std (planted: the field ignored); the std an
    unset init_std derives at this width (32) imports unset, and an absent field as transformers
    reads it, 0.02 (a re-export then writes what the folder meant, not this width's std)."""
    from megazero.convert.hf import HFSource
    from tests.convert_sources import llama_folder

    hf = llama_folder(tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    config["initializer_range"] = initializer_range
    if initializer_range is None:
        del config["initializer_range"]
    (hf / "config.json").write_text(json.dumps(config))
    assert HFSource(hf).cfg.init_std == init_std


def test_a_derived_std_an_ulp_off_imports_unset():
    """Exports used to compute the derived std as 1/(3h)**0.5, an ulp from 1/sqrt(3h) at some
    widths (2609): such a folder's initializer_range still reads back as an unset init_std."""
    from megazero.convert.hf import without_derived_init_std
    from models.config import ModelConfig

    cfg = ModelConfig(hidden_size=2609, init_std=1 / (3 * 2609) ** 0.5)
    assert cfg.init_std != replace(cfg, init_std=None).effective_init_std
    assert without_derived_init_std(cfg).init_std is None
    assert without_derived_init_std(replace(cfg, init_std=0.01)).init_std == 0.01


def test_a_sharded_bf16_export_indexes_its_bytes(tmp_path):
    """A bf16 export in several files: the index's metadata.total_size is the bytes of every tensor
    at 2 bytes an element (as transformers counts it), its weight_map names each tensor's file, and
    transformers loads the folder (planted: the size counted at 4 bytes an element)."""
    from safetensors import safe_open

    torch.manual_seed(0)
    write_megazero(RandomSource(num_layers=2, position_embedding="rope", norm="rmsnorm", activation="swiglu",
                           tie_embeddings=False), tmp_path / "mz")
    assert convert(tmp_path / "mz", tmp_path / "hf", "--dtype", "bf16", "--shard-size-gb", 2e-6) == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files, files
    elements, where = 0, {}
    for file in files:
        with safe_open(tmp_path / "hf" / file, "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                shape, dtype = f.get_slice(key).get_shape(), f.get_slice(key).get_dtype()
                assert dtype == "BF16", (key, dtype)
                elements += math.prod(shape)
                where[key] = file
    assert index["weight_map"] == where
    assert index["metadata"]["total_size"] == 2 * elements
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")
    assert sum(p.numel() for p in auto.parameters()) == elements


# --- megazero -> megazero and -> torch: what the source run recorded beside its weights -------------

SCALER = {"kind": "DynamicLossScaler", "scale": 4096.0, "clean_steps": 17, "hysteresis_left": 1}
TOKENIZER = {"tokenizer_sha256": "ab" * 32, "vocab_size": 40, "name": "tok.json"}
SHARDS = {"data/corpus_text_document": "cd" * 32}


@pytest.fixture
def run(tmp_path):
    """A consolidated megazero checkpoint at step 7, 1234 samples in, with Adam moments, an fp16
    loss-scaler state and a tokenizer record, as a run that trained would hold."""
    from megazero.config.schema import Config
    from megazero.convert.checkpoint_out import write_checkpoint
    from megazero.convert.layout import consolidated
    from megazero.convert.sources import logical_shapes

    source = RandomSource(num_layers=2)
    shapes = logical_shapes(source.cfg)
    g = torch.Generator().manual_seed(2)
    values = {}
    for name, shape in shapes.items():
        values[name] = {key: torch.randn(shape, generator=g).abs() for key in STATE_KEYS}
        if name.startswith("embedding.tokens"):
            for t in values[name].values():
                t[source.cfg.vocab_size:] = 0  # vocabulary padding
    meta = {"step": 7, "consumed": 1234, "skipped": 2, "bad_in_row": 1, "config": asdict(Config(model=source.cfg)),
            "tokenizer": TOKENIZER, "shards": SHARDS}
    write_checkpoint(tmp_path / "src", consolidated(shapes, source.cfg.num_layers),
                     lambda name, keys: {k: values[name][k] for k in keys}, step=7, meta=meta, with_moments=True,
                     adam_step=7.0, scaler=SCALER)
    return tmp_path / "src", values


def test_offline_reshard_carries_progress_scaler_tokenizer_and_shard_records(run, tmp_path):
    src, values = run
    assert convert(src, tmp_path / "out", "--to", "megazero") == 0
    assert (tmp_path / "out" / "latest").read_text().strip() == "step_0000007"
    new = CheckpointReader(latest_checkpoint(tmp_path / "out"))
    assert (new.meta["step"], new.meta["consumed"], new.meta["skipped"], new.meta["bad_in_row"]) == (7, 1234, 2, 1)
    assert new.meta["tokenizer"] == TOKENIZER
    assert new.meta["shards"] == SHARDS  # a resume still notices a shard preprocessed again since
    assert new.values(0, ("adam_step", "scaler")) == {"adam_step": 7.0, "scaler": SCALER}
    for name, want in values.items():
        got = new.read(name, STATE_KEYS)
        for key in STATE_KEYS:
            assert torch.equal(got[key], want[key]), (name, key)


@pytest.mark.parametrize("target", ["megazero", "torch"])
def test_every_file_a_conversion_publishes_was_synced_first(run, tmp_path, monkeypatch, target):
    """DST appears by a rename; its files (the index, manifests, ``COMPLETE`` were plain writes) are
    fsynced before it, or a power loss after the rename could leave a DST of empty files. Every file
    under DST keeps its inode through the rename, so each must have been fsynced by inode, and DST's
    folder after. (Planted: no sync before the rename.)"""
    import os

    synced = set()
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.add(os.fstat(fd).st_ino), fsync(fd))[1])
    src, _ = run
    dst = tmp_path / ("out" if target == "megazero" else "sd.safetensors")
    assert convert(src, dst, "--to", target) == 0
    published = [dst] if dst.is_file() else [p for p in dst.rglob("*")]
    assert published and all(p.stat().st_ino in synced for p in published), [p for p in published
                                                                              if p.stat().st_ino not in synced]
    assert tmp_path.stat().st_ino in synced


def test_reset_step_starts_afresh_from_the_same_weights(run, tmp_path):
    src, values = run
    assert convert(src, tmp_path / "out", "--to", "megazero", "--reset-step") == 0
    new = CheckpointReader(latest_checkpoint(tmp_path / "out"))
    assert (new.meta["step"], new.meta["consumed"]) == (0, 0)
    assert new.values(0, ("adam_step",))["adam_step"] == 0.0
    assert new.values(0, ("scaler",))["scaler"] != SCALER
    for name, want in values.items():
        got = new.read(name, STATE_KEYS)
        assert torch.equal(got["master"], want["master"]), name
        assert not got["exp_avg"].any() and not got["exp_avg_sq"].any(), name


def test_state_dict_file_describes_its_model(run, tmp_path):
    from safetensors import safe_open

    from megazero.convert.targets import STATE_DICT_METADATA

    src, _ = run
    assert convert(src, tmp_path / "sd.safetensors", "--to", "torch") == 0
    with safe_open(tmp_path / "sd.safetensors", "pt") as f:
        recorded = json.loads(f.metadata()[STATE_DICT_METADATA])
    assert recorded == asdict(RandomSource(num_layers=2).cfg)


def test_offline_reshard_takes_the_adam_step_of_ranks_that_updated(tmp_path):
    """At dp 16 the last ranks of this tiny model hold only padding; a training rank with nothing to
    update saves Adam step 0, so the step carried over is the largest over ranks, not any one's."""
    from megazero.checkpoint import read_manifest
    from megazero.checkpoint.format import CHECKSUM, COMPLETE, complete_text, rank_manifest_name
    from megazero.config import load_config, resolve_config
    from megazero.convert.checkpoint_out import _write_rank, write_checkpoint
    from megazero.convert.layout import training_layout
    from megazero.convert.sources import logical_shapes

    cfg = resolve_config(load_config(None, [
        "--model.num_layers", "2", "--model.hidden_size", "8", "--model.num_heads", "2", "--model.vocab_size", "40",
        "--model.seq_length", "8", "--train.micro_batch_size", "1", "--train.global_batch_size", "16",
        "--train.device", "cpu", "--precision.dtype", "fp32", "--zero.stage", "1"]), 16)
    layout = training_layout(cfg)
    empty = [r for r, plan in enumerate(layout.ranks) if not plan.segments]
    assert empty and 0 not in empty
    shapes = logical_shapes(cfg.model, vocab_multiple=128)
    g = torch.Generator().manual_seed(3)
    values = {name: {key: torch.randn(shape, generator=g) for key in STATE_KEYS} for name, shape in shapes.items()}
    for t in values["embedding.tokens.weight"].values():
        t[40:] = 0

    def read(name, keys):
        return {k: values[name][k] for k in keys}

    meta = {"step": 7, "consumed": 112, "skipped": 0, "bad_in_row": 0, "config": asdict(cfg)}
    ckpt = write_checkpoint(tmp_path / "src", layout, read, step=7, meta=meta, with_moments=True, adam_step=7.0,
                            scaler=SCALER)
    record = {k: v for k, v in read_manifest(ckpt).items() if k != CHECKSUM}
    for rank in empty:  # what those ranks of the training run saved
        entries = _write_rank(ckpt, rank, layout.ranks[rank], read, True, 0.0, SCALER)
        (ckpt / rank_manifest_name(rank)).write_text(json.dumps({"rank": rank, "step": 7, "files": entries}, indent=1))
        record["files"].update(entries)
    (ckpt / COMPLETE).write_text(complete_text(record))
    assert convert(tmp_path / "src", tmp_path / "out", "--to", "megazero") == 0
    new = CheckpointReader(latest_checkpoint(tmp_path / "out"))
    assert new.values(0, ("adam_step",))["adam_step"] == 7.0


def test_offline_reshard_drops_the_source_layouts_own_choices(tmp_path):
    """A tp2 x pp2 run with sequence parallelism, two virtual stages, its own split and schedule (a
    resumed run records the split it kept) converts to one rank: none of those fit there, and no
    flag could unset them, so they revert to their defaults instead of refusing the conversion."""
    from megazero.config import load_config
    from megazero.convert.checkpoint_out import write_checkpoint
    from megazero.convert.layout import consolidated
    from megazero.convert.sources import logical_shapes

    source = RandomSource(num_layers=4)
    shapes = logical_shapes(source.cfg)
    cfg = load_config(None, ["--parallel.tp", "2", "--parallel.pp", "2", "--parallel.virtual_stages", "2",
                             "--parallel.sequence_parallel", "true", "--parallel.pipeline_split", "[1, 1, 1, 1]",
                             "--parallel.pipeline_schedule", "interleaved_1f1b"])
    meta = {"step": 3, "consumed": 48, "skipped": 0, "bad_in_row": 0,
            "config": asdict(replace(cfg, model=source.cfg))}
    write_checkpoint(tmp_path / "src", consolidated(shapes, 4), lambda name, keys: {k: torch.ones(shapes[name])
                                                                                    for k in keys},
                     step=3, meta=meta, with_moments=True, adam_step=3.0)
    assert convert(tmp_path / "src", tmp_path / "out", "--to", "megazero", "--tp", "1", "--pp", "1", "--dp", "1") == 0
    recorded = CheckpointReader(latest_checkpoint(tmp_path / "out")).meta["config"]["parallel"]
    assert (recorded["sequence_parallel"], recorded["virtual_stages"], recorded["pipeline_split"],
            recorded["pipeline_schedule"]) == (False, 1, None, "auto")
