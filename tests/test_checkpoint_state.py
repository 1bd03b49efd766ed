"""Checkpoint state across changes that keep the layout dict but not the flat buckets, on 2 gloo ranks.

* Resuming with another ``zero.bucket_size_mb`` (same tp/pp/dp/stage) must not copy shards element
  for element: the shard descriptions differ, so the loader reshards, and the weights and Adam
  moments land where they belong (compared exactly with a same-bucket resume). Two steps are run
  after every resume: the first one's loss reads only the loaded weights, the second one's also the
  update the first made from the loaded moments and Adam step count (its bias correction).
* A shard saved with more padding after its last segment than this layout has (the flat layout of
  older versions padded units less) describes itself the same, but is resharded, not copied.
* Either way, in the same layout each rank's random generators continue from its own file.
* A loss-scaler state saved under fp16 is not imposed on a bf16 run, and vice versa; the load prints
  nothing (rank 0 of a launch says it, once).
* A byte flipped in the rank files or in the index files is refused while resharding, naming the file,
  and by an exact load without a plan. A load handed its plan (``files_to_load``, which checked the
  files) hashes none of them again, but refuses them if they are no longer the files hashed; its
  fallback from an exact plan to resharding hashes what it reads. A file changed under one rank's
  load stops every rank of the load's group with that rank's line; an error of another kind on one
  rank (a bug, an unreadable file) too, the rank raising its own.
* fp16 gradients kept in 16 bits under a 2^16 loss scale: the global norm is computed in fp32, so a
  large but finite gradient is not mistaken for an overflow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from megazero.checkpoint import CheckpointWriter, read_manifest
from megazero.checkpoint.reader import index_file, rank_file
import megazero.checkpoint.state as state
from megazero.checkpoint.state import files_to_load, load_checkpoint, rank_files
from megazero.config import load_config
from megazero.engine import Engine
from megazero.optim import STATE_KEYS, DynamicLossScaler
from tests.sharded import sharded_adamw
from parallel.topology import RankGrid, Topology
from tests.distributed import run_world


@contextlib.contextmanager
def _hashing():
    """The names of the files whose sha256 is computed inside the block, in order."""
    import megazero.checkpoint.format as fmt

    hashed, digest = [], fmt.file_digest
    fmt.file_digest = lambda f: hashed.append(os.path.basename(f.name)) or digest(f)
    try:
        yield hashed
    finally:
        fmt.file_digest = digest


def _engine(topo, bucket_mb: float, dtype: str = "fp32", extra=()) -> Engine:
    cfg = load_config(None, [*extra, "--model.num_layers", "2", "--model.hidden_size", "32", "--model.num_heads", "4",
                             "--model.vocab_size", "61", "--model.seq_length", "16", "--zero.stage", "1",
                             "--zero.bucket_size_mb", str(bucket_mb), "--precision.dtype", dtype,
                             "--train.micro_batch_size", "2", "--train.global_batch_size", "4",
                             "--parallel.dp", str(topo.dp_size), "--train.device", "cpu",
                             "--optimizer.lr", "1e-2"])
    return Engine(cfg, topo, torch.device("cpu"))


def _step(engine, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 61, (2, 17), generator=g)
    return engine.train_step([{"tokens": t[:, :-1], "labels": t[:, 1:]}]).loss


def _next_losses(engine) -> tuple[float, float]:
    """The losses of the two steps after a resume (see the module docstring for why two)."""
    return float(_step(engine, 10)), float(_step(engine, 11))


def _save(engine, root, rank):
    writer = CheckpointWriter(root, rank=rank, world_size=2, barrier=dist.barrier)
    writer.save(2, rank_files(engine.chunks, engine.optimizer, rank), meta={"step": 2})
    return root + "/step_0000002"


def _world(rank, world_size, root):
    topo = Topology(RankGrid(tp=1, pp=1, dp=2))
    out = {}
    source = _engine(topo, 0.002)
    for s in range(2):
        _step(source, s)
    saved_rng = torch.get_rng_state()
    ckpt = _save(source, root, rank)
    manifest = read_manifest(ckpt)
    reference_next = _next_losses(source)
    for bucket_mb in (0.002, 0.0005):
        target = _engine(topo, bucket_mb)
        torch.manual_seed(1000 + rank)  # as a fresh process would have it
        reads, description = [], state._description  # the shard descriptions read, planning and loading
        state._description = lambda *args: reads.append(args[1]) or description(*args)
        try:
            plan = files_to_load(ckpt, rank, target.optimizer, manifest, same_ranks=True)
            with _hashing() as hashed:
                exact = load_checkpoint(ckpt, rank, target.chunks, target.optimizer, manifest, same_ranks=True,
                                        plan=plan)
        finally:
            state._description = description
        out[("exact", bucket_mb)] = exact
        out[("planned", bucket_mb)] = (plan.exact, plan.files, reads)
        out[("hashed again", bucket_mb)] = hashed
        out[("rng restored", bucket_mb)] = torch.equal(torch.get_rng_state(), saved_rng)
        out[("next_loss", bucket_mb)] = (_next_losses(target), reference_next)
    out.update(_offload_resume(topo, rank, root + "/offload"))
    out["longer_shard"] = _longer_shard_resume(topo, rank, root + "/longer", reference_next)
    fp16 = _engine(topo, 0.002, "fp16")
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        load_checkpoint(ckpt, rank, fp16.chunks, fp16.optimizer, manifest, same_ranks=True)
    out["fp16_scale_after_fp32_ckpt"] = fp16.optimizer.scaler.scale
    out["fp16_load_note"] = (printed.getvalue(), fp16.optimizer.scaler_note)
    out["fp16_norm"] = _fp16_norm(topo)
    out["files_read"] = _pipeline_reshard_reads(rank, root)
    out.update(_damaged_reshard(topo, rank, ckpt, root + "/damaged"))
    out.update(_swapped_after_plan(topo, rank, ckpt, root + "/swapped"))
    for swapped in ((0,), (0, 1)):
        out["swapped", swapped] = _swapped_under_the_load(topo, rank, ckpt, root + f"/swapped_{len(swapped)}", swapped)
    return out


def _damaged_reshard(topo, rank, ckpt, root):
    """A checkpoint with one byte flipped in every rank file, or in every index file, resumed into
    other buckets (the resharding reader, not the exact copy): each rank must refuse it, naming a
    damaged file, rather than load the flipped value or misplace elements by a damaged table."""
    import shutil
    from megazero.checkpoint import CheckpointError

    out = {}
    for kind, name in (("rank file", rank_file), ("index file", index_file)):
        damaged = f"{root}/{kind.replace(' ', '_')}"
        if rank == 0:
            shutil.copytree(ckpt, damaged)
            for r in range(2):
                with open(f"{damaged}/{name(r)}", "r+b") as f:  # the last byte: tensor data, not the header
                    f.seek(-1, 2)
                    last = f.read(1)
                    f.seek(-1, 2)
                    f.write(bytes([last[0] ^ 0x40]))
        dist.barrier()
        target = _engine(topo, 0.0005)
        try:
            load_checkpoint(damaged, rank, target.chunks, target.optimizer, read_manifest(damaged), same_ranks=False)
            out[("damaged", kind)] = None
        except CheckpointError as e:
            out[("damaged", kind)] = str(e)
        exact = _engine(topo, 0.002)  # the same buckets: an exact resume, which without a plan checks as it reads
        try:
            load_checkpoint(damaged, rank, exact.chunks, exact.optimizer, read_manifest(damaged), same_ranks=True)
            out[("damaged exactly", kind)] = None
        except CheckpointError as e:
            out[("damaged exactly", kind)] = str(e)
        dist.barrier()
    return out


def _swapped_after_plan(topo, rank, ckpt, root):
    """Every rank file replaced by another of its size (a re-save of the step swapping the directory)
    between the plan, which hashed it, and the load, which reads it unhashed: exactly or resharded,
    each rank must refuse it rather than load bytes nobody checked."""
    import shutil
    from megazero.checkpoint import CheckpointError

    out = {}
    for bucket_mb in (0.002, 0.0005):
        swapped = f"{root}/{bucket_mb}"
        if rank == 0:
            shutil.copytree(ckpt, swapped)
        dist.barrier()
        target = _engine(topo, bucket_mb)
        manifest = read_manifest(swapped)
        plan = files_to_load(swapped, rank, target.optimizer, manifest, same_ranks=True)
        dist.barrier()
        if rank == 0:
            for r in range(2):
                _swap_for_a_flipped_copy(f"{swapped}/{rank_file(r)}")
        dist.barrier()
        try:
            load_checkpoint(swapped, rank, target.chunks, target.optimizer, manifest, same_ranks=True, plan=plan)
            out[("swapped after plan", bucket_mb)] = (plan.exact, None)
        except CheckpointError as e:
            out[("swapped after plan", bucket_mb)] = (plan.exact, str(e))
    return out


def _swap_for_a_flipped_copy(path: str) -> None:
    """Replace ``path`` by a copy of it of the same size, its last byte flipped (a re-save's rename)."""
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0x40
    with open(f"{path}.new", "wb") as f:
        f.write(data)
    os.replace(f"{path}.new", path)


def _swapped_under_the_load(topo, rank, ckpt, root, swapped):
    """The files of the ranks ``swapped`` replaced between the plan and an exact load, which loads the
    ranks as one group: rank 0 meets the change, and rank 1, reading its own whole file or meeting its
    change too, must stop with rank 0's line, the first rank's, rather than wait in the load's
    all-gather for a rank that has stopped. Returns the error this rank raised (None: it loaded) and
    a sum over the data-parallel group after it, which a collective one rank started alone (the
    load's all-gather) would leave out of step."""
    import shutil
    from megazero.checkpoint import CheckpointError

    if rank == 0:
        shutil.copytree(ckpt, root)
    dist.barrier()
    target, manifest = _engine(topo, 0.002), read_manifest(root)
    plan = files_to_load(root, rank, target.optimizer, manifest, same_ranks=True, group=dist.group.WORLD)
    dist.barrier()
    if rank == 0:
        for r in swapped:
            _swap_for_a_flipped_copy(f"{root}/{rank_file(r)}")
    dist.barrier()
    error = None
    try:
        load_checkpoint(root, rank, target.chunks, target.optimizer, manifest, same_ranks=True, plan=plan,
                        group=dist.group.WORLD)
    except CheckpointError as e:
        error = str(e)
    total = torch.ones(1)
    dist.all_reduce(total, group=topo.dp_group)
    return error, total.item()


def _longer_shard_resume(topo, rank, root, reference_next):
    source = _engine(topo, 0.002)
    for s in range(2):
        _step(source, s)
    for key in STATE_KEYS:  # 64 more elements of padding at the end of the shard
        setattr(source.optimizer, key, torch.cat([getattr(source.optimizer, key), torch.zeros(64)]))
    ckpt = _save(source, root, rank)
    target = _engine(topo, 0.002)
    exact = load_checkpoint(ckpt, rank, target.chunks, target.optimizer, read_manifest(ckpt), same_ranks=True)
    # planned: the plan says exact (the descriptions agree), and the load falls back to resharding
    planned = _engine(topo, 0.002)
    plan = files_to_load(ckpt, rank, planned.optimizer, read_manifest(ckpt), same_ranks=True)
    with _hashing() as hashed:
        load_checkpoint(ckpt, rank, planned.chunks, planned.optimizer, read_manifest(ckpt), same_ranks=True, plan=plan)
    return exact, _next_losses(target), reference_next, (plan.exact, hashed)


def _offload_resume(topo, rank, root):
    """An offloaded run saved between steps (its update still pending) resumes, offloaded or not, to
    the very loss it would have reached."""
    offload = ("--zero.offload_optimizer", "true")
    source = _engine(topo, 0.002, extra=offload)
    for s in range(2):
        _step(source, s)
    ckpt = _save(source, root, rank)
    want = _next_losses(source)
    out = {}
    for extra in (offload, ()):
        target = _engine(topo, 0.002, extra=extra)
        load_checkpoint(ckpt, rank, target.chunks, target.optimizer, read_manifest(ckpt), same_ranks=True)
        out[("offload_resume", bool(extra))] = (_next_losses(target), want)
    return out


def _pipeline_reshard_reads(rank, root):
    """pp2 (untied head): resharding into other buckets reads only this stage's rank file."""
    from megazero.checkpoint.reader import CheckpointReader, rank_file

    topo = Topology(RankGrid(tp=1, pp=2, dp=1))
    untied = ("--parallel.pp", "2", "--model.tie_embeddings", "false")
    source = _engine(topo, 0.002, extra=untied)
    _step(source, 0)
    ckpt = _save(source, root + "/pp", rank)
    reads, real = set(), CheckpointReader._open
    CheckpointReader._open = lambda self, r: (reads.add(rank_file(r)), real(self, r))[1]
    try:
        target = _engine(topo, 0.0005, extra=untied)
        load_checkpoint(ckpt, rank, target.chunks, target.optimizer, read_manifest(ckpt), same_ranks=True)
    finally:
        CheckpointReader._open = real
    return sorted(reads)


def _fp16_norm(topo):
    """Every gradient element 1000 in fp16 storage (loss scale 100): finite everywhere, but a shard's
    norm, 2000·sqrt(5000) after the sum over 2 ranks, is past fp16's largest value (65504)."""
    model = torch.nn.Linear(100, 100, bias=False)
    opt = sharded_adamw(model, topo.dp_group, stage=2, param_dtype=torch.float16, grad_dtype=torch.float16,
                        clip_grad=0.0, loss_scaler=DynamicLossScaler(initial_scale=100.0))
    x = torch.ones((1, 100), dtype=torch.float16)
    opt.scale_loss(model(x).sum() * 10.0).backward()  # d/dW = 10 per element, times the scale 100
    result = opt.step()
    return result.skipped, result.grad_norm


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_world(2, _world, str(tmp_path_factory.mktemp("ckpt")))


def test_same_buckets_resume_exactly(report):
    for r in report:
        assert r[("exact", 0.002)] is True
        got, want = r[("next_loss", 0.002)]
        assert got == want


def test_offloaded_run_resumes_exactly_with_or_without_offload(report):
    for r in report:
        for offloaded in (True, False):
            got, want = r[("offload_resume", offloaded)]
            assert got == want, (offloaded, got, want)


def test_a_resume_reads_its_shard_description_once(report):
    """The plan made while checking the files says whether the resume is exact, and the load takes
    it (planted: the load deciding again, which reads the description a second time)."""
    for rank, r in enumerate(report):
        assert r[("planned", 0.002)] == (True, [rank_file(rank)], [rank])
        assert r[("planned", 0.0005)][0] is False and r[("planned", 0.0005)][2] == [rank]


def test_other_buckets_reshard_instead_of_scrambling(report):
    for r in report:
        assert r[("exact", 0.0005)] is False
        got, want = r[("next_loss", 0.0005)]
        assert got == pytest.approx(want, rel=1e-6), (got, want)


@pytest.mark.parametrize("bucket_mb", [0.002, 0.0005])
def test_random_generators_resume_in_the_same_layout_whether_exact_or_resharded(report, bucket_mb):
    """A rank that reshards (other buckets) beside tensor-group peers that resume exactly would
    otherwise draw other dropout masks than they do."""
    assert all(r[("rng restored", bucket_mb)] for r in report)


def test_a_planned_load_hashes_nothing_again(report):
    """The plan's files were checked (sha256) as it was made; the load, exact or resharded, reads them
    without hashing each again (planted: the exact load verifying again, or the resharding reader
    made with ``verify=True`` whatever the plan)."""
    for r in report:
        assert r[("hashed again", 0.002)] == [] and r[("hashed again", 0.0005)] == []


def test_a_longer_shard_with_the_same_description_is_resharded(report):
    """Planned or not: the plan says exact (the descriptions agree), and the load's fallback to
    resharding reads files the plan never checked, so it hashes them, and them alone (planted: the
    fallback trusting the plan, ``verify=False``; or forgetting what the plan hashed)."""
    for rank, r in enumerate(report):
        exact, got, want, (planned_exact, hashed) = r["longer_shard"]
        other = 1 - rank
        assert planned_exact is True and sorted(hashed) == [index_file(other), rank_file(other)], hashed
        assert exact is False
        assert got == pytest.approx(want, rel=1e-6), (got, want)


def test_loss_scale_not_carried_across_precisions(report):
    """The scale starts afresh, and the optimizer leaves saying so to the trainer's rank 0: it printed
    the line itself, once per rank of the launch (planted back: every rank's load printed)."""
    assert all(r["fp16_scale_after_fp32_ckpt"] == 65536.0 for r in report)
    for r in report:
        printed, note = r["fp16_load_note"]
        assert printed == "" and "ConstantLossScaler" in note and "DynamicLossScaler" in note, r["fp16_load_note"]


def test_fp16_gradient_norm_is_computed_in_fp32(report):
    for r in report:
        skipped, norm = r["fp16_norm"]
        # the mean gradient is 10 in each of 10,000 elements: norm 1000
        assert not skipped and norm == pytest.approx(1000.0, rel=1e-3), (skipped, norm)


def test_reshard_reads_only_the_files_holding_this_ranks_parameters(report):
    for rank, r in enumerate(report):
        assert r["files_read"] == [f"rank_{rank:05d}.safetensors"], r["files_read"]


def test_a_run_without_a_split_resumes_with_its_checkpoints_split():
    """The default pipeline split changed (balanced by work); a checkpoint written under the old
    default must still load into its own layout, exactly (a different split reshards and loses the
    random generators). Planted: without the kept split the records differ."""
    from megazero.config import load_config, resolve_config
    from megazero.engine import layout_record, pipeline_split
    from megazero.trainer import checkpoint_split

    def cfg(*extra):
        return resolve_config(load_config("configs/gpt_1.3b.yaml", ["--parallel.pp", "2", *extra]), 2, 2)

    old = cfg("--parallel.pipeline_split", "[12, 12]")  # what the old default wrote
    run = cfg()
    assert pipeline_split(run) == [13, 11]
    kept = checkpoint_split(run, layout_record(old))
    assert kept == [12, 12]
    resumed = dataclasses.replace(run, parallel=dataclasses.replace(run.parallel, pipeline_split=kept))
    assert layout_record(resumed) == layout_record(old)
    # a split the user sets wins; another pipeline shape takes the default (and reshards)
    assert checkpoint_split(cfg("--parallel.pipeline_split", "[14, 10]"), layout_record(old)) == [14, 10]
    assert checkpoint_split(cfg("--parallel.virtual_stages", "2"), layout_record(old)) is None
    # nor is a split of another depth kept: its stages would not hold the model's blocks
    assert checkpoint_split(cfg("--model.num_layers", "26"), layout_record(old)) is None


@pytest.mark.parametrize("kind", ["rank file", "index file"])
def test_a_damaged_checkpoint_is_refused_when_resharded(report, kind):
    for rank, out in enumerate(report):
        error = out[("damaged", kind)]
        assert error is not None, f"rank {rank} loaded a checkpoint with a flipped byte in each {kind}"
        name = rank_file if kind == "rank file" else index_file
        assert "sha256" in error and any(f"/{name(r)}:" in error for r in range(2)), (rank, error)


@pytest.mark.parametrize("bucket_mb, exact", [(0.002, True), (0.0005, False)])
def test_a_file_swapped_between_the_plan_and_the_load_is_refused(report, bucket_mb, exact):
    """The plan's files are read unhashed only if they are the files it hashed (planted: the plan
    keeping their names alone, and the load checking their sizes, which loaded the swapped bytes)."""
    for rank, out in enumerate(report):
        planned_exact, error = out[("swapped after plan", bucket_mb)]
        assert planned_exact is exact and error is not None, (rank, error)
        assert "changed while it was read" in error and "/rank_0000" in error and "\n" not in error, (rank, error)


@pytest.mark.parametrize("swapped", [(0,), (0, 1)], ids=["rank-0", "both"])
def test_a_file_changed_under_one_ranks_load_stops_every_rank_with_that_ranks_line(report, swapped):
    """Only rank 0 read the replaced file: rank 1 loaded its own and went on into the load's
    all-gather, where it waited for rank 0, which had stopped with the one line (planted: no agreement
    before the load's all-gather; the all-gather started before it). Both raise rank 0's line as it
    is, naming that rank and its file, and so where both ranks met a change (planted: the last rank's
    line; the line prefixed with its type), and the data-parallel group is still in step."""
    outcomes = [r["swapped", swapped] for r in report]
    errors = [error for error, _ in outcomes]
    assert errors[0] is not None and errors[1] == errors[0], errors
    assert errors[0].startswith("rank 0: /") and "\n" not in errors[0], errors[0]
    assert f"/swapped_{len(swapped)}/{rank_file(0)}: the checkpoint changed while it was read" in errors[0], errors[0]
    assert [total for _, total in outcomes] == [2.0, 2.0], outcomes


def test_an_error_without_a_message_is_named_by_its_type():
    """A peer's line names the error a rank met by its type where it says nothing (planted: an empty
    line after the rank)."""
    assert state._one_line(AssertionError()) == "AssertionError"
    assert state._one_line(KeyError("rng")) == "KeyError: 'rng'"


def _refused_on_rank_1(rank, world_size, root, exactly, error=ValueError):
    """A load, exact or resharded, whose rank 1 meets an error that is no ``CheckpointError`` (the
    optimizer refusing the saved values): returns what each rank raised, with whether it is agreed on
    and the function whose frame ends its traceback, and a sum over the data-parallel group after it,
    which a rank that started the load's all-gather before the agreement leaves out of step."""
    topo = Topology(RankGrid(tp=1, pp=1, dp=2))
    source = _engine(topo, 0.002)
    _step(source, 0)
    ckpt = _save(source, root, rank)
    target = _engine(topo, 0.002)
    if rank == 1:
        def refuse(*args, **kwargs):
            raise error("the saved shard\nis laid out differently")
        setattr(target.optimizer, "load_sharded_state_dict" if exactly else "load_local_state", refuse)
    raised = None
    try:
        load_checkpoint(ckpt, rank, target.chunks, target.optimizer, read_manifest(ckpt), same_ranks=exactly,
                        group=dist.group.WORLD)
    except BaseException as e:  # noqa: BLE001 - what each rank raised is the result
        raised = type(e).__name__, str(e), getattr(e, "agreed", None), traceback.extract_tb(e.__traceback__)[-1].name
    total = torch.ones(1)
    dist.all_reduce(total, group=topo.dp_group)
    return raised, total.item()


@pytest.mark.parametrize("exactly", [True, False], ids=["exact", "resharded"])
def test_an_error_of_any_kind_on_one_rank_stops_its_peers_with_its_one_line(tmp_path, exactly):
    """Rank 1's ValueError passed the ranks' agreement, which took only a ``CheckpointError``: rank 0 waited
    in it for rank 1 (until the group's timeout, minutes, or its lost connection), then died with a
    traceback (planted: ``except CheckpointError``; rank 0's reads publishing its shard, the load's
    all-gather, before the agreement, exact or resharded).
    Rank 1 raises its own error, its traceback kept; rank 0 one line naming rank 1 and that error, marked
    agreed (rank 0 says it for every rank that raises it); the data-parallel group is still in step."""
    (failed, failed_sum), (refused, refused_sum) = run_world(2, _refused_on_rank_1, str(tmp_path), exactly,
                                                             timeout=60)
    assert refused == ("ValueError", "the saved shard\nis laid out differently", None, "refuse"), refused
    assert failed[:3] == ("CheckpointError", "rank 1: ValueError: the saved shard is laid out differently", True)
    assert failed_sum == refused_sum == 2.0


def test_an_interrupt_on_one_rank_stops_its_peers_with_its_one_line(tmp_path):
    """A Ctrl-C (a ``KeyboardInterrupt``) that reached rank 1 alone inside its load
    passed the agreement, which took ``Exception``: rank 0 waited for rank 1 until the group's timeout
    (planted: ``except Exception``). Rank 1 raises its interrupt; rank 0 one line naming it."""
    (stopped, _), (interrupted, _) = run_world(2, _refused_on_rank_1, str(tmp_path), True, KeyboardInterrupt,
                                               timeout=60)
    assert interrupted[0] == "KeyboardInterrupt", interrupted
    assert stopped[:3] == ("CheckpointError", "rank 1: KeyboardInterrupt: the saved shard is laid out differently",
                           True), stopped


@pytest.mark.parametrize("kind", ["rank file", "index file"])
def test_a_damaged_checkpoint_is_refused_by_an_exact_load_without_a_plan(report, kind):
    """Without a plan (whose files were checked as it was made) the exact load checks what it reads
    (planted: ``verify=verified`` where it is ``not verified``)."""
    for rank, out in enumerate(report):
        error = out[("damaged exactly", kind)]
        name = rank_file if kind == "rank file" else index_file
        assert error is not None and f"/{name(rank)}: sha256" in error, (rank, error)


def test_a_checkpoint_of_another_placement_leaves_its_split_behind():
    """Between the loop (interleaved) and the V (zb-v) of the same pp and virtual stages each rank holds
    other stages, so the load reshards anyway: the run takes its own default split, balanced for its
    placement (the V's head sits on the first rank), not one balanced for the other. Planted: the
    split kept whenever pp and virtual stages match."""
    from megazero.config import load_config, resolve_config
    from megazero.engine import layout_record, pipeline_split
    from megazero.trainer import checkpoint_split

    def cfg(schedule):
        return resolve_config(load_config("configs/gpt_1.3b.yaml", [
            "--parallel.pp", "2", "--parallel.virtual_stages", "2", "--parallel.pipeline_schedule", schedule]), 2, 2)

    loop, v = cfg("interleaved_1f1b"), cfg("zb-v")
    assert pipeline_split(loop) != pipeline_split(v)
    assert checkpoint_split(v, layout_record(loop)) is None
    assert checkpoint_split(loop, layout_record(v)) is None
    assert checkpoint_split(v, layout_record(v)) == pipeline_split(v)


@pytest.mark.parametrize("record,line", [
    ({"tp": 2, "pp": 2, "dp": 2, "virtual_stages": 1, "order": "tp-dp-pp", "zero_stage": 1, "world_size": 8,
      "pipeline_split": [3, 1]}, "tp2 x pp2 x dp2, ZeRO-1, split [3, 1]"),
    ({"tp": 1, "pp": 2, "dp": 1, "virtual_stages": 2, "zero_stage": 3, "pipeline_split": [1, 1, 1, 1],
      "placement": "v"}, "tp1 x pp2 x dp1, ZeRO-3, 2 chunks a rank, split [1, 1, 1, 1] placed v"),
    ({"tp": 1, "pp": 1, "dp": 1, "virtual_stages": 1, "zero_stage": 0, "pipeline_split": [4],
      "written_by": "megazero convert"}, "tp1 x pp1 x dp1, ZeRO-0, written by megazero convert"),
])
def test_a_resharded_resume_names_the_layout_it_came_from_in_words(record, line):
    """The resume line read "resharded from {'tp': 1, ...}", the record as a Python dict."""
    from megazero.engine import describe_layout

    assert describe_layout(record) == line


class _StubOptimizer:
    """The two questions a load's plan asks of a rank's optimizer: the shard it holds, and the
    logical tensors it needs."""

    def __init__(self, description: dict, tensors: list):
        self.description, self.tensors = description, tensors

    def describe(self) -> dict:
        return self.description

    def local_tensors(self) -> list:
        return self.tensors


def _padding_rank_checkpoint(root) -> str:
    """A two-rank checkpoint of one parameter ``a``, all of it in rank 0's file: rank 1's shard was
    padding alone. Written by one process (the writer's rank 0 takes any file names), then its record
    resealed as two ranks'."""
    import json

    from megazero.checkpoint.format import COMPLETE, complete_text

    flat = torch.arange(4.0)
    files = {}
    for r, (master, segments) in enumerate([(flat, [[0, 0, 0, 4]]), (torch.zeros(4), [])]):
        files[rank_file(r)] = {"master": master, "exp_avg": master, "exp_avg_sq": master, "adam_step": 1 - r,
                               "scaler": None, "rng": {}}
        files[index_file(r)] = {"params": [["a", [4], None]],
                                "segments": torch.tensor(segments, dtype=torch.int64).reshape(-1, 4)}
    CheckpointWriter(root, rank=0, world_size=1, barrier=lambda: None).save(1, files)
    ckpt = root / "step_0000001"
    record = json.loads((ckpt / COMPLETE).read_text())
    (ckpt / COMPLETE).write_text(complete_text({**record, "world_size": 2}))
    return str(ckpt)


def test_a_plan_checks_the_own_file_a_resharded_rank_takes_its_generators_from(tmp_path):
    """In the same layout a resharded rank restores its random generators from its own file, so the
    plan checks that file with the ones holding its tensors, though it holds none of them: damaged, it
    is refused before the load, with every rank's plan, not inside it on this rank alone (planted: the
    plan naming the holders only)."""
    ckpt = _padding_rank_checkpoint(tmp_path)
    rank1 = _StubOptimizer({"params": [["a", [4], None]], "segments": torch.tensor([[0, 0, 0, 4]])},
                           [("a", (4,), None)])
    plan = files_to_load(ckpt, 1, rank1, read_manifest(ckpt), same_ranks=True)
    assert (plan.exact, plan.files) == (False, [rank_file(0), rank_file(1)])
    path = tmp_path / "step_0000001" / rank_file(1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(state.CheckpointError, match=f"{path}: sha256"):
        files_to_load(ckpt, 1, rank1, read_manifest(ckpt), same_ranks=True)

