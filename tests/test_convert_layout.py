"""`megazero convert --tp --pp --dp --zero-stage --virtual-stages --pipeline-schedule`: a checkpoint
written offline in a run's own layout.

The layout is computed without a process group (``convert.layout.training_layout``); it must equal,
rank by rank, the shard description the engine's optimizer gives when that run really starts (on
4 gloo ranks, six layouts: tensor x pipeline, pipeline x data with interleaving and ZeRO-3, tensor x
data with ZeRO-2 and a persistence threshold, plain data parallelism, pipeline x data with a split
that cuts a block in half, pipeline x data in zb-v's V). The files written in that layout
must give back every logical tensor of the source, and the engine at that layout must load them into
exactly the values the source holds. A layout the model cannot take is refused in one line naming the
field, with nothing written. The trainer reshards a converted checkpoint (consolidated or in its own
layout) rather than resume it as one it saved itself: the layout record names the converter.

Planted bugs these caught: the offline layout ignoring the persistence threshold (stage 2 case
differs), tensor-parallel shapes not applied offline (every tp case differs), the tied head copy named
by its own name (the pipeline cases differ).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megazero.checkpoint import CheckpointError, latest_checkpoint, read_manifest
from megazero.checkpoint.reader import CheckpointReader, Piece, _cover
from megazero.checkpoint.state import load_checkpoint
from megazero.cli import main
from megazero.config import load_config, resolve_config
from megazero.convert.layout import training_layout
from megazero.convert.targets import write_megazero
from megazero.engine import Engine
from megazero.optim import shard_description
from models import GPT
from models.gpt import VOCAB_PADDED
from models.embedding import padded_vocab_size
from parallel.tensor_parallel.sharding import param_shards
from parallel.topology import RankGrid, Topology
from tests.distributed import run_world

VOCAB = 61
MODEL = ["--model.num_layers", "4", "--model.hidden_size", "32", "--model.num_heads", "4", "--model.vocab_size",
         str(VOCAB), "--model.seq_length", "16", "--train.micro_batch_size", "1", "--train.global_batch_size", "8",
         "--train.device", "cpu", "--zero.bucket_size_mb", "0.002", "--precision.dtype", "fp32"]
LAYOUTS = {
    "tp2-pp2-zero1": ["--parallel.tp", "2", "--parallel.pp", "2", "--zero.stage", "1"],
    "pp2-dp2-v2-zero3": ["--parallel.pp", "2", "--parallel.virtual_stages", "2", "--zero.stage", "3"],
    "tp2-dp2-zero2-persist": ["--parallel.tp", "2", "--zero.stage", "2", "--zero.persistence_threshold", "100"],
    "dp4-zero0": ["--zero.stage", "0", "--model.preset", "llama"],
    "pp2-dp2-half-zero1": ["--parallel.pp", "2", "--parallel.pipeline_split", "[1.5, 2.5]", "--zero.stage", "1"],
    "pp2-dp2-zbv-zero1": ["--parallel.pp", "2", "--parallel.virtual_stages", "2", "--parallel.pipeline_schedule",
                          "zb-v", "--zero.stage", "1"],
}


def _config(name: str):
    return resolve_config(load_config(None, MODEL + LAYOUTS[name]), 4)


class _Source:
    """A source of logical tensors (what `megazero convert` reads from HF, Megatron or megazero)."""

    kind = "test"

    def __init__(self, cfg):
        self.cfg = cfg
        model = GPT(cfg, seed=5)
        self.tensors = {name: p.detach()[:VOCAB].clone() if name in VOCAB_PADDED else p.detach().clone()
                        for name, p in model.named_parameters()}
        self.names = list(self.tensors)

    def read(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def _world(rank, world_size, root):
    out = {}
    for name in LAYOUTS:
        cfg = _config(name)
        p = cfg.parallel
        engine = Engine(cfg, Topology(RankGrid(tp=p.tp, pp=p.pp, dp=p.dp, order=p.order)), torch.device("cpu"))
        mine = engine.optimizer.describe()
        plan = training_layout(cfg).ranks[rank]
        offline = shard_description(plan.params, plan.segments)
        same = offline["params"] == mine["params"] and torch.equal(offline["segments"], mine["segments"])
        ckpt = latest_checkpoint(f"{root}/{name}")
        load_checkpoint(ckpt, rank, engine.chunks, engine.optimizer, read_manifest(ckpt), same_ranks=True)
        source = _Source(cfg.model)
        engine.data_parallel.wait_params()
        loaded = all(torch.equal(q.detach(), _expected(chunk, n, source))
                     for chunk in engine.chunks for n, q in chunk.named_parameters())
        out[name] = {"same": same, "loaded": loaded}
    return out


def _expected(chunk, name: str, source: _Source) -> torch.Tensor:
    """This rank's slice of the source's logical tensor, padded to this layout's vocabulary."""
    full = source.tensors[chunk.logical_name(name)]
    if name in VOCAB_PADDED:
        full = torch.cat([full, full.new_zeros(chunk.padded_vocab - VOCAB, *full.shape[1:])])
    shard = param_shards(chunk).get(name)
    return full if shard is None else shard.take(full)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    for name in LAYOUTS:
        cfg = _config(name)
        write_megazero(_Source(cfg.model), root / name, run=cfg)
    return root


@pytest.fixture(scope="module")
def report(written):
    return run_world(4, _world, str(written))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_offline_layout_is_the_engines(report, name):
    assert all(r[name]["same"] for r in report), [r[name] for r in report]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_engine_loads_the_source_values(report, name):
    assert all(r[name]["loaded"] for r in report), [r[name] for r in report]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_files_give_back_every_logical_tensor(written, name):
    cfg = _config(name)
    reader = CheckpointReader(latest_checkpoint(written / name))
    source = _Source(cfg.model)
    assert len(reader.ranks) == 4 and set(reader.shapes) == set(source.names)
    padded = padded_vocab_size(VOCAB, 128 * cfg.parallel.tp)
    for name_, want in source.tensors.items():
        got = reader.read(name_)["master"]
        if name_ in VOCAB_PADDED:
            assert got.shape[0] == padded and not got[VOCAB:].any()
            got = got[:VOCAB]
        assert torch.equal(got, want), name_


def test_reading_plan_takes_each_element_once_and_refuses_a_gap():
    """The reader's plan over the rank files' segments: an element two files hold (a tied head's
    copy, cut at other offsets than the embedding it copies) is read once, a segment overlapping
    what is already read gives only its new tail, from the matching place in its shard, one lying
    wholly inside it (ending before or where the read part ends) adds nothing, and a single element
    held nowhere makes the parameter incomplete instead of leaving it as whatever the uninitialised
    buffer held. (Planted: copies inside the read part not skipped, which planned reads of negative
    or zero length and moved the read part's end back.)"""
    first = Piece(0, None, (10,), ((0, 100, 6),))  # elements 0-5 at offset 100 of rank 0's shard
    copy = Piece(1, None, (10,), ((4, 200, 6),))  # elements 4-9 at offset 200 of rank 1's
    assert _cover([first, copy], 10) == {0: [(0, 100, 6)], 1: [(6, 202, 4)]}
    inside = Piece(2, None, (10,), ((1, 300, 3), (2, 400, 4)))  # elements 1-3 and 2-5, read from rank 0
    assert _cover([first, inside, copy], 10) == {0: [(0, 100, 6)], 1: [(6, 202, 4)]}
    after_a_gap = Piece(1, None, (10,), ((7, 300, 3),))  # elements 7-9: element 6 is nowhere
    assert _cover([first, after_a_gap], 10) is None
    assert _cover([first], 10) is None  # the tail, elements 6-9, is nowhere
    assert _cover([Piece(0, None, (10,), ((0, 100, 9),))], 10) is None  # the last element alone is nowhere


def test_a_tensor_slice_held_by_no_rank_file_is_an_incomplete_checkpoint(written):
    """A tp-sharded parameter whose second slice no rank file holds is refused, naming the
    parameter and the slices found, instead of being assembled around an uninitialised half."""
    reader = CheckpointReader(latest_checkpoint(written / "tp2-pp2-zero1"))
    name = next(n for n, pieces in reader.pieces.items()
                if any(p.shard is not None and p.shard.index == 1 for p in pieces))
    reader.pieces[name] = [p for p in reader.pieces[name] if p.shard.index != 1]
    with pytest.raises(CheckpointError, match=rf"{name!r} has tp slices \[0\] of 2.*incomplete"):
        reader.read(name)


def test_layout_the_model_cannot_take_is_refused(written, tmp_path, capsys):
    src = latest_checkpoint(written / "dp4-zero0")
    dst = tmp_path / "out"
    assert main(["convert", str(src), str(dst), "--to", "megazero", "--tp", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "model.num_heads" in err and "parallel.tp 3" in err, err
    assert not dst.exists() and not list(tmp_path.glob(".out.*"))


def test_cli_writes_the_layout(written, tmp_path):
    src = latest_checkpoint(written / "dp4-zero0")
    dst = tmp_path / "tp2"
    assert main(["convert", str(src), str(dst), "--to", "megazero", "--tp", "2", "--dp", "1", "--pp", "2"]) == 0
    manifest = read_manifest(latest_checkpoint(dst))
    layout = manifest["meta"]["layout"]
    assert (layout["tp"], layout["pp"], layout["dp"], manifest["world_size"]) == (2, 2, 1, 4)
    recorded = manifest["meta"]["config"]["parallel"]
    assert (recorded["tp"], recorded["pp"], recorded["dp"]) == (2, 2, 1)


def _layout(order: str):
    cfg = resolve_config(load_config(None, MODEL + ["--parallel.pp", "2", "--zero.stage", "1",
                                                    "--parallel.order", order]), 4)
    assert (cfg.parallel.pp, cfg.parallel.dp) == (2, 2)
    return training_layout(cfg)


def test_rank_order_places_each_coordinates_plan_on_its_rank():
    default, other = _layout("tp-dp-pp"), _layout("tp-pp-dp")
    grid = RankGrid(tp=1, pp=2, dp=2, order="tp-pp-dp")
    by_coord = {RankGrid(tp=1, pp=2, dp=2).coord(r): plan for r, plan in enumerate(default.ranks)}
    assert len({tuple(p.params) for p in default.ranks}) > 1  # the stages hold different parameters
    moved = 0
    for rank, plan in enumerate(other.ranks):
        want = by_coord[grid.coord(rank)]
        assert (plan.params, plan.segments, plan.numel) == (want.params, want.segments, want.numel), rank
        moved += plan != default.ranks[rank]
    assert moved > 0  # the orders really differ here
    assert other.description["order"] == "tp-pp-dp"


# --- a converted checkpoint is never resumed as a run's own ----------------------------------------

RESUMES = {  # what `megazero convert` writes, and the run whose layout record it otherwise equals
    "consolidated": ["--zero.stage", "0"],  # HF / Megatron import, or --to megazero without layout flags
    "run-layout": ["--zero.stage", "1"],  # --to megazero --dp 1 --zero-stage 1
    "fp16": ["--zero.stage", "0", "--precision.dtype", "fp16"],  # a converted model trained in fp16
}


def _resume_config(root: str, name: str, converted: bool = True):
    """The run of ``name``'s layout, from the converted checkpoint or (``converted`` False) afresh."""
    start = ["--logging.run_dir", f"{root}/{name}/run", "--checkpoint.load", f"{root}/{name}/converted"] \
        if converted else ["--logging.run_dir", f"{root}/{name}/fresh"]
    return resolve_config(load_config(None, MODEL + RESUMES[name] + [
        "--data.blend", f"[[1.0, {root}/data/tokens]]", "--data.split", "1", "--train.train_steps", "1", *start]), 1)


def _resume_world(rank, world_size, root):
    """Start the trainer on each converted checkpoint: what it says of the resume, whether its random
    generators are those of the same run started afresh (not the converter's, written beside the
    weights), and whether every parameter holds the source's value."""
    import contextlib
    import io

    from megazero.startup import initialize
    from megazero.trainer import Trainer
    from parallel.launch import LaunchEnv

    out = {}
    for name in RESUMES:
        rng = {}
        for converted in (False, True):
            cfg = _resume_config(root, name, converted)
            device, topology = initialize(cfg, LaunchEnv(rank, world_size, rank, world_size))
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                trainer = Trainer(cfg, device, topology)
            rng[converted] = torch.get_rng_state()
        engine, source = trainer.engine, _Source(cfg.model)
        engine.data_parallel.wait_params()
        out[name] = {"printed": printed.getvalue(), "rng_of_a_fresh_run": torch.equal(rng[True], rng[False]),
                     "loaded": all(torch.equal(q.detach(), _expected(chunk, n, source).to(q.dtype))
                                   for chunk in engine.chunks for n, q in chunk.named_parameters())}
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    from data_pipeline.indexed import IndexedDatasetWriter

    root = tmp_path_factory.mktemp("resume")
    with IndexedDatasetWriter(str(root / "data" / "tokens"), np.uint16) as writer:
        for doc in range(64):
            writer.add_document((np.arange(40) * (doc % 5 + 1)) % VOCAB)
    for name in RESUMES:
        cfg = _resume_config(str(root), name)
        write_megazero(_Source(cfg.model), root / name / "converted", run=cfg if name == "run-layout" else None)
    return root, run_world(1, _resume_world, str(root))[0]


@pytest.mark.parametrize("name", list(RESUMES))
def test_a_converted_checkpoint_is_resharded_not_resumed_exactly(resumed, name):
    """The layout record names the converter (``written_by``): it is all that tells a converted
    checkpoint from one the run itself saved in the same layout, whose resume would restore the
    converter's random generators as the run's. The trainer must say it resharded, keep its own
    generators and load the source's values (planted: ``written_by`` left out of the record; the
    run-layout case was then resumed as "same layout", the consolidated one took the converter's
    generators). The loss scaler the converter saves none of is named once, in an fp16 run only,
    where its scale starts afresh (planted: the note dropped, or said in a bf16 run)."""
    from megazero.engine import describe_layout, layout_record

    root, report = resumed
    layout = read_manifest(latest_checkpoint(root / name / "converted"))["meta"]["layout"]
    assert layout["written_by"] == "megazero convert", layout
    assert {k: v for k, v in layout.items() if k != "written_by"} == layout_record(_resume_config(str(root), name))
    resumes = [line for line in report[name]["printed"].splitlines() if "resumed from" in line]
    assert len(resumes) == 1 and "same layout" not in resumes[0], resumes
    assert resumes[0].endswith(f"(resharded from {describe_layout(layout)})")
    assert "written by megazero convert" in resumes[0]
    notes = [line for line in report[name]["printed"].splitlines() if "note:" in line]
    assert notes == (["megazero: note: the checkpoint holds no loss-scaler state (a converted model): the fp16 "
                      "loss scale starts at 65536"] if name == "fp16" else []), notes
    assert report[name]["rng_of_a_fresh_run"]
    assert report[name]["loaded"]


def test_cli_writes_a_v_layout(written, tmp_path, capsys):
    """``--pipeline-schedule zb-v``: the files of a V, whose first rank holds the first and the last
    stage, recorded as such, and a name that is no schedule refused in one line with nothing written.
    (Planted: the flag's value dropped, which wrote a loop, its first rank holding stages 0 and 2.)"""
    src = latest_checkpoint(written / "dp4-zero0")
    dst = tmp_path / "zbv"
    assert main(["convert", str(src), str(dst), "--to", "megazero", "--pp", "2", "--virtual-stages", "2",
                 "--dp", "1", "--pipeline-schedule", "zb-v"]) == 0
    ckpt = latest_checkpoint(dst)
    manifest = read_manifest(ckpt)
    assert manifest["meta"]["layout"]["placement"] == "v"
    assert manifest["meta"]["config"]["parallel"]["pipeline_schedule"] == "zb-v"
    pieces = CheckpointReader(ckpt).pieces
    holders = {layer: {p.rank for name, held in pieces.items() if name.startswith(f"layers.{layer}.") for p in held}
               for layer in range(4)}
    assert holders == {0: {0}, 1: {1}, 2: {1}, 3: {0}}, holders
    bad = tmp_path / "bad"
    assert main(["convert", str(src), str(bad), "--to", "megazero", "--pp", "2", "--pipeline-schedule", "zb-x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "parallel.pipeline_schedule" in err and "zb-x" in err, err
    assert not bad.exists()


def test_a_split_made_for_a_loop_is_not_carried_into_a_v(tmp_path):
    """A source run's own split balanced a loop's ranks; the same pipeline shape laid out as a V puts
    other stages together, so the converted run takes the V's default split. (Planted: the split kept.)"""
    cfg = resolve_config(load_config(None, MODEL + ["--parallel.pp", "2", "--parallel.virtual_stages", "2",
                                                    "--parallel.pipeline_split", "[1.5, 0.5, 1, 1]"]), 4)
    write_megazero(_Source(cfg.model), tmp_path / "src", run=cfg)
    src = latest_checkpoint(tmp_path / "src")
    for name, extra, split in (("loop", [], [1.5, 0.5, 1, 1]), ("v", ["--pipeline-schedule", "zb-v"], None)):
        assert main(["convert", str(src), str(tmp_path / name), "--to", "megazero", "--dp", "1", *extra]) == 0
        recorded = read_manifest(latest_checkpoint(tmp_path / name))["meta"]["config"]["parallel"]
        assert recorded["pipeline_split"] == split, (name, recorded["pipeline_split"])


def _source_run(tmp_path, *layout):
    """A megazero checkpoint (consolidated) whose recorded run had ``layout`` on 4 ranks."""
    cfg = resolve_config(load_config(None, MODEL + list(layout)), 4)
    write_megazero(_Source(cfg.model), tmp_path / "src", run=cfg)
    return latest_checkpoint(tmp_path / "src")


def test_a_change_of_virtual_stages_alone_drops_the_runs_split_and_schedule(tmp_path):
    """From pp 2 with two virtual stages, its own four-stage split and interleaved 1F1B, ``--virtual-stages
    1`` keeps the pipeline's depth but not its stages: the split and the schedule made for them revert
    to their defaults rather than refuse the conversion. (Planted: only a change of pp counted as a new
    pipeline shape, so the four-stage split was kept for two stages and the conversion refused.)"""
    src = _source_run(tmp_path, "--parallel.pp", "2", "--parallel.virtual_stages", "2",
                      "--parallel.pipeline_split", "[1.5, 0.5, 1, 1]", "--parallel.pipeline_schedule", "interleaved_1f1b")
    assert main(["convert", str(src), str(tmp_path / "out"), "--to", "megazero", "--virtual-stages", "1"]) == 0
    recorded = read_manifest(latest_checkpoint(tmp_path / "out"))["meta"]["config"]["parallel"]
    assert (recorded["pp"], recorded["virtual_stages"], recorded["pipeline_split"], recorded["pipeline_schedule"]) \
        == (2, 1, None, "auto"), recorded


def test_explicit_layout_flags_are_taken_as_given(tmp_path, capsys):
    """What the layout flags name is never replaced by a default: ``--dp 2`` writes a dp 2 layout (4
    ranks at tp 2), and ``--pp 1 --virtual-stages 2`` or ``--pp 4 --pipeline-schedule interleaved_1f1b``
    (without virtual stages) is refused in one line naming the field, not quietly made ``1`` or
    ``auto`` as the source run's own values are. (Planted: dp taken as 1 for the world; the virtual
    stages reset at pp 1 though flagged; the schedule reset for a new pipeline shape though flagged.)"""
    src = _source_run(tmp_path, "--parallel.pp", "2", "--parallel.virtual_stages", "2")
    assert main(["convert", str(src), str(tmp_path / "dp2"), "--to", "megazero", "--tp", "2", "--pp", "1",
                 "--dp", "2"]) == 0
    manifest = read_manifest(latest_checkpoint(tmp_path / "dp2"))
    layout = manifest["meta"]["layout"]
    assert (layout["tp"], layout["pp"], layout["dp"], manifest["world_size"]) == (2, 1, 2, 4)

    for name, flags, field in (("v", ["--pp", "1", "--virtual-stages", "2"], "parallel.virtual_stages"),
                               ("sched", ["--pp", "4", "--virtual-stages", "1", "--pipeline-schedule",
                                          "interleaved_1f1b"], "parallel.pipeline_schedule")):
        capsys.readouterr()
        assert main(["convert", str(src), str(tmp_path / name), "--to", "megazero", "--dp", "1", *flags]) == 2, name
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and field in err, err
        assert not (tmp_path / name).exists()


def test_a_model_without_a_run_takes_any_dp(tmp_path):
    """A Hugging Face model has no run, so the default batch (16 samples, micro-batches of 4) stands in
    for one; at ``--dp 3`` it divided into no whole number of micro-batches per rank, and the refusal
    told the user to change train.global_batch_size, which convert has no flag for. It becomes the
    next multiple of dp micro-batches. (Planted: the default kept: refused.)"""
    from tests.convert_sources import llama_folder

    assert main(["convert", str(llama_folder(tmp_path / "hf")), str(tmp_path / "dp3"), "--to", "megazero",
                 "--dp", "3"]) == 0
    manifest = read_manifest(latest_checkpoint(tmp_path / "dp3"))
    assert manifest["meta"]["layout"]["dp"] == 3
    train = manifest["meta"]["config"]["train"]
    assert (train["micro_batch_size"], train["global_batch_size"]) == (4, 24)


def test_a_dp_that_regroups_a_batch_ramp_up_ahead_is_refused(tmp_path, capsys):
    """A checkpoint converted with its progress records DST's layout as its run's, so the resume's check
    that a new dp does not regroup a ramp-up's samples into other steps compared dp 4 with dp 4 and
    passed: at step 3 (12 samples) of a ramp from 2 by 2 at dp 4, whose steps are rounded to multiples
    of 4 samples, dp 2 makes the next step 2 samples, not 4. Convert refuses it in one line, and takes dp 2 once the ramp is over, or with --reset-step."""
    from megazero.convert.sources import MegazeroSource

    ramp = ["--schedule.rampup_start_batch", "2", "--schedule.rampup_increment", "2"]
    for name, samples in (("mid", "100"), ("after", "12")):
        source = MegazeroSource(_source_run(tmp_path / name, *ramp, "--schedule.rampup_samples", samples))
        source.reader.meta.update(step=3, consumed=12)  # as a run three steps into its ramp-up saved it
        write_megazero(source, tmp_path / name / "run")
    capsys.readouterr()
    argv = ["convert", str(latest_checkpoint(tmp_path / "mid" / "run")), str(tmp_path / "dp2"), "--to", "megazero",
            "--dp", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("megazero convert: error: --dp 2: the checkpoint (step 3) would train "
                                              "the step at sample 12 on a global batch of 2 instead of 4"), err
    assert "keep the run's dp 4" in err and not (tmp_path / "dp2").exists()
    assert main([*argv, "--reset-step"]) == 0
    assert main(["convert", str(latest_checkpoint(tmp_path / "after" / "run")), str(tmp_path / "after_dp2"),
                 "--to", "megazero", "--dp", "2"]) == 0

