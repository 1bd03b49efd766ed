"""Faults a cluster throws at a run, injected on purpose; none may lose or change what was trained.

* ``kill -9`` of the whole launch (torchrun and every worker, as a lost node or an OOM killer would)
  at seeded random moments of a 2-rank run that saves every 2 steps, a third of them timed to land
  inside a save (while a ``step_N.tmp`` directory exists). Every relaunch resumes on its own and
  ends with a ``metrics.jsonl`` whose rows equal the uninterrupted run's exactly (loss, lr, grad
  norm, consumed samples: bit for bit, since floats are written at full precision) and a final
  checkpoint whose weights are bitwise the uninterrupted run's. Two kill points run in CI, the other
  eighteen under ``-m slow`` (all twenty with a plain ``pytest``).
* A NaN written into one rank's gradient: the step is skipped on every rank (the weights do not
  move anywhere), training goes on, and a NaN gradient every step stops the run with the divergence
  message even though every loss is finite.
* A rank that stops calling collectives: its peers fail within the group's timeout with an error
  naming their rank, the operation and the group.

Planted bugs these caught: resuming without restoring the data position (rows differ after the
kill); a guard that counts only non-finite losses (the NaN-gradient run exits "finished").
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from megazero.checkpoint import latest_checkpoint, verify_checkpoint
from megazero.checkpoint.state import load_full_weights
from megazero.metrics import read_metrics
from tests.distributed import run_world
from tests.test_trainer import (FIELDS, _launch, _overrides, _signal_tree, _wait_for, _write_config,  # noqa: F401
                                data_prefix, train_from_file)

STEPS = 16
SAVE_EVERY = 2


@pytest.fixture(scope="module")
def reference(data_prefix, tmp_path_factory):  # noqa: F811 - the fixture imported above
    root = tmp_path_factory.mktemp("reference")
    cfg = _write_config(root / "run.yaml", data_prefix, str(root / "run"), SAVE_EVERY)
    run_world(2, train_from_file, cfg, STEPS)  # trains as the launch does, bit for bit
    rows = read_metrics(root / "run" / "metrics.jsonl")
    weights = load_full_weights(latest_checkpoint(root / "run" / "checkpoints"))
    return rows, weights


def _kill_and_resume(prefix, root, point: int) -> tuple[list, dict, str]:
    """Kill the launch at kill point ``point`` (seeded), relaunch to the end; returns what it left."""
    rng = random.Random(point)
    cfg = _write_config(root / "run.yaml", prefix, str(root / "run"), SAVE_EVERY)
    metrics, ckpts = root / "run" / "metrics.jsonl", root / "run" / "checkpoints"
    proc = _launch(cfg, STEPS, nproc=2)
    if point % 3 == 0:  # inside a save: the moment a temporary checkpoint directory appears
        after = rng.randint(0, STEPS // SAVE_EVERY // 2 - 1) * SAVE_EVERY  # leaves several saves to catch
        reached = _wait_for_save(ckpts, after, proc)
    else:
        lines = rng.randint(1, STEPS - 5)  # a step lasts tens of milliseconds: land before the last
        reached = _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= lines, proc)
        time.sleep(rng.uniform(0, 0.05))
    _signal_tree(proc.pid, signal.SIGKILL)
    killed_out, _ = proc.communicate()
    assert reached and proc.returncode == -signal.SIGKILL, f"kill point {point} came too late:\n{killed_out}"
    last = latest_checkpoint(ckpts)
    assert last is None or int(last.name.split("_")[1]) < STEPS, f"kill point {point} hit a finished run"
    proc = _launch(cfg, STEPS, nproc=2)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"relaunch after kill point {point} failed:\n{out}"
    ckpt = latest_checkpoint(ckpts)
    verify_checkpoint(ckpt)
    return read_metrics(metrics), load_full_weights(ckpt), killed_out + out


def _wait_for_save(ckpts, after: int, proc, timeout: float = 240) -> bool:
    """Poll tightly (a save of this small model lasts milliseconds) for a save of a step past ``after``
    in progress; True once one is seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            names = os.listdir(ckpts)
        except FileNotFoundError:
            names = []
        if any(n.endswith(".tmp") and n.startswith("step_") and int(n[5:-4]) > after for n in names):
            return True
        time.sleep(0.0005)
    return False


def _check_identical(reference, resumed, point):
    ref_rows, ref_weights = reference
    rows, weights, out = resumed
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), (point, out)
    for a, b in zip(rows, ref_rows):
        assert {k: a[k] for k in FIELDS} == {k: b[k] for k in FIELDS}, (point, a, b)
    assert weights.keys() == ref_weights.keys()
    for name in weights:
        assert torch.equal(weights[name], ref_weights[name]), (point, name)


@pytest.mark.parametrize("point", [0, 1])
def test_kill_9_then_resume_is_bit_identical(reference, data_prefix, tmp_path, point):  # noqa: F811
    _check_identical(reference, _kill_and_resume(data_prefix, tmp_path, point), point)


@pytest.mark.slow
@pytest.mark.parametrize("point", range(2, 20))
def test_kill_9_at_many_moments_then_resume_is_bit_identical(reference, data_prefix, tmp_path, point):  # noqa: F811
    _check_identical(reference, _kill_and_resume(data_prefix, tmp_path, point), point)


# --- NaN gradients on one rank, and a rank that stops calling collectives ------------------------

def _nan_world(rank, world_size, prefix, root):
    import torch.distributed as dist

    from megazero.config import load_config, resolve_config
    from megazero.errors import UserError
    from megazero.startup import initialize
    from megazero.trainer import Trainer
    from parallel.launch import LaunchEnv

    from megazero.checkpoint import latest_checkpoint

    out = {}
    for case, poisoned_steps in (("once", {3}), ("always", set(range(2, 100))), ("apart", {2, 4, 6}),
                                 ("saved", set(range(6, 100)))):
        cfg = resolve_config(load_config(None, _overrides(prefix, f"{root}/{case}", steps=12, extra=(
            "--train.max_bad_steps", "3", "--checkpoint.save_on_exit", "false", "--checkpoint.save_interval",
            "4" if case == "saved" else "0"))), world_size)
        device, topology = initialize(cfg, LaunchEnv(rank, world_size, 0, world_size))
        trainer = Trainer(cfg, device, topology)
        trainer.writer.async_save = True  # what checkpoint.async_save does on a GPU (the save's thread)
        param = next(trainer.engine.chunks[0].parameters())
        if rank == 1:  # only this rank's gradient goes bad
            param.register_hook(lambda g: g.fill_(float("nan")) if trainer.state.step + 1 in poisoned_steps else g)
        masters = {}  # the master weights as the steps queued so far leave them, by step
        original = trainer._queue_step

        def snapshot_then_queue():
            masters[trainer.state.step] = trainer.engine.optimizer.master.clone()
            return original()

        trainer._queue_step = snapshot_then_queue
        try:
            trainer.train()
            out[case] = {"error": None}
        except UserError as exc:
            out[case] = {"error": str(exc), "agreed": exc.agreed}
        masters[trainer.state.step] = trainer.engine.optimizer.master.clone()
        snapshots = {step: bool(torch.equal(masters[step - 1], masters[step])) for step in masters if step - 1 in masters}
        out[case].update(unchanged=snapshots, skipped=trainer.state.skipped,
                         committed=str(latest_checkpoint(cfg.save_dir)))
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def nan_results(data_prefix, tmp_path_factory):  # noqa: F811
    return run_world(2, _nan_world, data_prefix, str(tmp_path_factory.mktemp("nan")), timeout=300)


def test_a_nan_gradient_on_one_rank_skips_the_step_on_every_rank(nan_results):
    for rank, result in enumerate(nan_results):
        once = result["once"]
        assert once["error"] is None, (rank, once)
        assert once["skipped"] == 1, (rank, once)
        assert once["unchanged"][3] and not any(v for s, v in once["unchanged"].items() if s != 3), (rank, once)


def test_nan_gradients_with_finite_losses_stop_the_run(nan_results):
    for rank, result in enumerate(nan_results):
        always = result["always"]
        assert always["error"] is not None and "NaN or inf for 3 steps in a row" in always["error"], (rank, always)
        assert always["agreed"], "every rank stops on this line: rank 0 alone should print it"
        assert always["skipped"] == 4, (rank, always)  # the three in a row, and the step queued behind them


def test_a_diverging_run_commits_the_save_its_background_thread_wrote(nan_results, tmp_path_factory):
    """A save written in the background is committed at the next save or the run's end; a run stopped
    by divergence (steps 6 on NaN, stopped at 8) reached neither, so its step-4 checkpoint, written
    whole, stayed an unfinished .tmp, and the relaunch its error advises started from step 0. Every
    rank stops on that error together, so the save is committed first. (Planted: not committed.)"""
    for rank, result in enumerate(nan_results):
        saved = result["saved"]
        assert "NaN or inf for 3 steps in a row" in saved["error"], (rank, saved)
        assert saved["committed"].endswith("saved/checkpoints/step_0000004"), (rank, saved)


def test_bad_steps_apart_are_no_divergence(nan_results):
    """Three bad steps with good ones between them, under max_bad_steps 3: each is skipped, and the
    run finishes (only bad steps in a row stop it)."""
    for rank, result in enumerate(nan_results):
        apart = result["apart"]
        assert apart["error"] is None and apart["skipped"] == 3, (rank, apart)


def _hung_peer_world(rank, world_size):
    from parallel import comm
    from parallel.topology import RankGrid, Topology

    # the run's own groups, which took torch's 30 minutes whatever train.collective_timeout_s said
    group = Topology(RankGrid(tp=1, pp=1, dp=world_size), timeout_s=2).group("dp")
    if rank == 1:
        time.sleep(6)  # never arrives in time
        return None
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4), group)
    except comm.CollectiveError as exc:
        return {"message": str(exc), "seconds": time.monotonic() - start}
    return {"message": None, "seconds": time.monotonic() - start}


def test_a_rank_that_stops_calling_collectives_fails_its_peers_naming_rank_group_and_operation():
    result = run_world(2, _hung_peer_world, timeout=60)[0]
    assert result["message"] is not None, result
    assert "rank 0: all_reduce on the" in result["message"] and "2 ranks [0, 1]" in result["message"], result
    assert result["seconds"] < 5, result
