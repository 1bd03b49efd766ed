"""The trainer end to end on CPU: layouts agree, checkpoints reshard, a killed run resumes exactly.

* One 8-rank gloo world trains the same model on the same data as tp2 x pp2 x dp2 under each ZeRO
  stage, and resumes a tp2 x pp2 x dp2 checkpoint as tp1 x pp2 x dp4 under ZeRO-3; a 1-rank world
  trains the single-process run and resumes the same checkpoint as one process. Losses agree within
  2e-4 relative (fp32; the layouts sum in different orders, and Adam amplifies that slightly).
  The single process also evaluates every 3 steps: the validation loss at step 3 equals that of a
  run that ends at step 3 (the trainer queues a step before reading the last one's results, and
  must not run ahead of a step it evaluates); and a time limit already passed ends the run after its
  first step (stop requests are agreed on before the next step is queued).
* ``torchrun`` runs of the real command: ``kill -9`` after a checkpoint, then a resume whose
  metrics.jsonl lines equal the uninterrupted run's exactly (loss, lr, grad norm); SIGTERM saves a
  loadable checkpoint and exits with status 75 (preempted).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import yaml

from data_pipeline.indexed import IndexedDatasetWriter
from megazero.checkpoint import latest_checkpoint, verify_checkpoint
from megazero.config import load_config, resolve_config
from megazero.metrics import read_metrics
from tests.distributed import run_world

VOCAB = 97
STEPS = 10


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    """Learnable documents: arithmetic progressions mod the vocabulary, each ended by token 0."""
    return write_arithmetic_shard(str(tmp_path_factory.mktemp("data") / "arith_text_document"), 400)


def write_arithmetic_shard(prefix: str, documents: int) -> str:
    """A shard of arithmetic progressions mod the vocabulary, each ended by token 0: data a small
    model learns within a few steps."""
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(documents):
            start, stride, length = rng.integers(1, VOCAB), rng.integers(1, 7), rng.integers(40, 200)
            doc = (start + stride * np.arange(length)) % (VOCAB - 1) + 1
            writer.add_document(np.append(doc, 0).astype(np.uint16))
    return prefix


def _overrides(prefix: str, run_dir: str, tp=1, pp=1, stage=1, steps=STEPS, extra=()):
    return ["--model.preset", "gpt2", "--model.num_layers", "4", "--model.hidden_size", "32",
            "--model.num_heads", "4", "--model.vocab_size", str(VOCAB), "--model.seq_length", "32",
            "--parallel.tp", str(tp), "--parallel.pp", str(pp), "--zero.stage", str(stage),
            "--zero.bucket_size_mb", "0.01", "--train.micro_batch_size", "2", "--train.global_batch_size", "16",
            "--train.train_steps", str(steps), "--train.device", "cpu", "--optimizer.lr", "3e-3",
            "--optimizer.min_lr", "3e-4", "--optimizer.eps", "1e-5", "--schedule.warmup_steps", "2",
            "--schedule.decay_steps", str(STEPS), "--data.blend", f"[[1.0, {prefix}]]",
            "--data.split", "1", "--logging.run_dir", run_dir, "--logging.log_interval", "1", *extra]


def _train(overrides, world_size, prepare=None, config_path=None):
    """Build and run a Trainer inside an already started world (``prepare(trainer)`` first, if
    given), from ``overrides`` on top of ``config_path`` or the defaults; returns the losses it
    logged."""
    import torch.distributed as dist

    from megazero.startup import initialize
    from megazero.trainer import Trainer
    from parallel.launch import LaunchEnv

    cfg = resolve_config(load_config(config_path, overrides), world_size)
    rank = dist.get_rank()  # one node: the local rank is the rank (it picks the GPU on a CUDA world)
    device, topology = initialize(cfg, LaunchEnv(rank, world_size, rank, world_size))
    trainer = Trainer(cfg, device, topology)
    if prepare is not None:
        prepare(trainer)
    trainer.train()
    dist.barrier()
    return [row["loss"] for row in read_metrics(os.path.join(cfg.logging.run_dir, "metrics.jsonl"))]


def train_from_file(rank, world_size, config_path, steps):
    """A world's run of a written config for ``steps`` steps: what ``megazero train CONFIG
    --train.train_steps STEPS`` trains, without a launch's start-up of a fresh interpreter for every
    rank (seconds of two cores each)."""
    return _train(["--train.train_steps", str(steps)], world_size, config_path=config_path)


def step_dirs(checkpoints: str) -> list[str]:
    """The step checkpoints in a checkpoint directory, oldest first."""
    return sorted(d for d in os.listdir(checkpoints) if d.startswith("step_"))


def _world8(rank, world_size, prefix, root):
    out = {}
    for stage in (0, 1, 2, 3):
        extra = (("--checkpoint.save_interval", "3", "--checkpoint.keep_last", "10") if stage == 1
                 else ("--checkpoint.save_on_exit", "false"))
        out[f"stage{stage}"] = _train(_overrides(prefix, f"{root}/tp2pp2dp2-z{stage}", 2, 2, stage, extra=extra),
                                      world_size)
    ckpt = f"{root}/tp2pp2dp2-z1/checkpoints/step_0000003"
    out["reshard_dp4"] = _train(_overrides(prefix, f"{root}/reshard-dp4", 1, 2, 3, extra=(
        "--checkpoint.load", ckpt, "--checkpoint.save_on_exit", "false")), world_size)
    # rank 0 profiles, the other seven do not: every rank must pause around the window alike
    profiled = f"{root}/profiled-rank0"
    out["profiled_rank0"] = _train(_overrides(prefix, profiled, 2, 2, steps=4, extra=(
        "--logging.profile_steps", "[2, 3]", "--logging.profile_ranks", "[0]",
        "--checkpoint.save_on_exit", "false")), world_size)
    out["profiled_rank0_files"] = sorted(os.listdir(os.path.join(profiled, "profile")))
    return out


def _world1(rank, world_size, prefix, root):
    from megazero.errors import UserError

    ckpt = f"{root}/tp2pp2dp2-z1/checkpoints/step_0000003"
    out = {"single": _train(_overrides(prefix, f"{root}/single", extra=("--checkpoint.save_on_exit", "false")), 1),
           "reshard_single": _train(_overrides(prefix, f"{root}/reshard-1", extra=(
               "--checkpoint.load", ckpt, "--checkpoint.save_on_exit", "false")), 1)}
    try:  # lr 1e6 without clipping: fp16 weights overflow to inf, and the loss is NaN from then on
        _train(_overrides(prefix, f"{root}/diverge", extra=(
            "--optimizer.lr", "1e6", "--optimizer.min_lr", "1e6", "--optimizer.clip_grad", "0", "--precision.dtype", "fp16",
            "--train.max_bad_steps", "3", "--checkpoint.save_on_exit", "false")), 1)
        out["diverge"] = None
    except UserError as exc:
        out["diverge"] = str(exc)
    out["diverge_metrics"] = read_metrics(os.path.join(root, "diverge", "metrics.jsonl"))
    _train(_overrides(prefix, f"{root}/late", extra=("--train.max_wall_seconds", "1e-9")), 1)
    out["late"] = ([row["step"] for row in read_metrics(os.path.join(root, "late", "metrics.jsonl"))],
                   sorted(os.listdir(os.path.join(root, "late", "checkpoints"))))
    profiled = f"{root}/profiled"
    _train(_overrides(prefix, profiled, steps=4, extra=("--logging.profile_steps", "[2, 3]",
                                                        "--checkpoint.save_on_exit", "false")), 1)
    out["profile_files"] = sorted(os.listdir(os.path.join(profiled, "profile")))
    out["host_wait"] = [row.get("host_wait_s") for row in read_metrics(os.path.join(profiled, "metrics.jsonl"))]
    with gzip.open(os.path.join(profiled, "profile", "rank0_steps2-3.json.gz"), "rt") as f:
        out["profile_ops"] = [(e.get("cat"), e.get("name")) for e in json.load(f)["traceEvents"]]
    out["evaluations"] = {}
    # step 3 evaluated as the run's last step, and with later steps to queue, one or three ahead
    for name, steps, ahead in ((3, 3, 1), (STEPS, STEPS, 1), ("ahead3", STEPS, 3)):
        run_dir = f"{root}/eval-{name}"
        _train(_overrides(prefix, run_dir, steps=steps, extra=(
            "--data.split", "9,1,0", "--train.eval_interval", "3", "--train.eval_steps", "1",
            "--checkpoint.save_on_exit", "false", "--train.steps_ahead", str(ahead))), 1)
        out["evaluations"][name] = [(row["step"], row["val_loss"]) for row in
                                    read_metrics(os.path.join(run_dir, "metrics.jsonl")) if row.get("val_loss") is not None]
    ahead = f"{root}/ahead3"
    out["ahead3"] = _train(_overrides(prefix, ahead, extra=("--train.steps_ahead", "3", "--checkpoint.save_interval", "4",
                                                            "--checkpoint.save_on_exit", "false")), 1)
    out["ahead3_checkpoints"] = step_dirs(os.path.join(ahead, "checkpoints"))
    _train(_overrides(prefix, f"{root}/late-ahead3", extra=("--train.max_wall_seconds", "1e-9",
                                                            "--train.steps_ahead", "3")), 1)
    out["late_ahead3"] = [row["step"] for row in read_metrics(os.path.join(root, "late-ahead3", "metrics.jsonl"))]
    out["stop_mid_ahead3"] = _stop_at_third_check(f"{root}/stop-mid", _overrides(prefix, f"{root}/stop-mid", extra=(
        "--train.steps_ahead", "3")))
    out["step_times"] = _step_times(f"{root}/timed", _overrides(prefix, f"{root}/timed", steps=6, extra=(
        "--checkpoint.save_interval", "3", "--checkpoint.save_on_exit", "false")))
    out.update(_limits_and_counters(prefix, root))
    return out


def _limits_and_counters(prefix, root):
    """Single-process runs of what a step count alone does not show: a token budget, the last
    step's periodic save, several evaluation batches, the learning rate per step, a batch ramp-up,
    and the skip counters a resume carries."""
    import torch.distributed as dist

    from data_pipeline.loader import global_batch
    from megazero.startup import initialize
    from megazero.trainer import Trainer
    from parallel.launch import LaunchEnv

    def rows(name):
        return read_metrics(os.path.join(root, name, "metrics.jsonl"))

    out = {}
    tokens = 16 * 32  # a global batch of 16 samples of 32 tokens
    for name, budget in (("tokens2", 2 * tokens), ("tokens1.5", 3 * tokens // 2)):
        _train(_overrides(prefix, f"{root}/{name}", extra=("--train.train_steps", "null", "--train.train_tokens",
                                                          str(budget), "--checkpoint.save_on_exit", "false")), 1)
        out[name] = [row["step"] for row in rows(name)]
    _train(_overrides(prefix, f"{root}/last-save", steps=4, extra=("--checkpoint.save_interval", "2",
                                                                   "--checkpoint.save_on_exit", "false")), 1)
    out["last_save"] = step_dirs(os.path.join(root, "last-save", "checkpoints"))
    out["lrs"] = [(row["step"], row["lr"]) for row in rows("single")]
    _train(_overrides(prefix, f"{root}/ramp", steps=5, extra=(
        "--schedule.rampup_start_batch", "8", "--schedule.rampup_increment", "8", "--schedule.rampup_samples", "32",
        "--checkpoint.save_on_exit", "false")), 1)
    out["ramp_tokens"] = [row["tokens"] for row in rows("ramp")]

    evaluated = {}

    def keep(trainer):
        evaluated["trainer"] = trainer
    _train(_overrides(prefix, f"{root}/eval2", steps=3, extra=(
        "--data.split", "9,1,0", "--train.eval_interval", "3", "--train.eval_steps", "2",
        "--checkpoint.save_on_exit", "false")), 1, prepare=keep)
    trainer = evaluated["trainer"]
    batches = [global_batch(trainer.valid_data, k * 16, 16, 2, 0, 1) for k in (0, 1)]
    out["eval2"] = ([row["val_loss"] for row in rows("eval2") if row.get("val_loss") is not None],
                    sum(trainer.engine.eval_loss(b) for b in batches) / 2)

    # told to stop (time is up) just after its periodic save of step 4: that save is the exit save
    saves = []

    def stop_once_saved(trainer):
        save = trainer.save

        def counted():
            saves.append(trainer.state.step)
            save()
        trainer.save = counted
        trainer._agree = lambda preempted, late: [preempted, trainer.saved_step >= 4]
    _train(_overrides(prefix, f"{root}/stop-saved", steps=6, extra=("--checkpoint.save_interval", "4")), 1,
           prepare=stop_once_saved)
    out["stop_saved"] = saves

    # steps 3 and 4 go bad (under max_bad_steps 5), the run saves at step 4; a resume keeps the counts
    def poison(trainer):
        param = next(trainer.engine.chunks[0].parameters())
        param.register_hook(lambda g: g.fill_(float("nan")) if trainer.state.step + 1 in (3, 4) else g)
    counted = _overrides(prefix, f"{root}/counted", steps=4, extra=("--train.max_bad_steps", "5"))
    _train(counted, 1, prepare=poison)
    cfg = resolve_config(load_config(None, [*counted, "--train.train_steps", "6"]), 1)
    device, topology = initialize(cfg, LaunchEnv(0, 1, 0, 1))
    import megazero.checkpoint.format as fmt

    hashed, digest = [], fmt.file_digest  # the files whose sha256 the resume computes
    fmt.file_digest = lambda f: hashed.append(os.path.basename(f.name)) or digest(f)
    try:
        resumed = Trainer(cfg, device, topology)
    finally:
        fmt.file_digest = digest
    out["counted"] = (resumed.state.step, resumed.state.skipped, resumed.state.bad_in_row, resumed._unsaved())
    out["resume_hashed"] = hashed

    # a checkpoint directory without room for one checkpoint is refused as the trainer is built
    import collections
    import shutil

    from megazero.checkpoint import CheckpointError

    usage, real = collections.namedtuple("usage", "total used free"), shutil.disk_usage
    shutil.disk_usage = lambda path: usage(1 << 30, (1 << 30) - 1, 1)
    try:
        Trainer(resolve_config(load_config(None, _overrides(prefix, f"{root}/no-room")), 1), device, topology)
        out["no_room"] = None
    except CheckpointError as exc:
        out["no_room"], out["no_room_agreed"] = str(exc), exc.agreed
    finally:
        shutil.disk_usage = real
    dist.barrier()
    return out


STEP_SLEEP = {1: 0.05, 2: 1.2, 3: 0.05, 4: 1.2, 5: 0.05, 6: 1.2}
"""Long and short steps alternate: a step logged with its neighbour's work is off by more than a
second, so the check leaves a busy machine a second of slack."""


def _step_times(run_dir, overrides):
    """Train one process whose engine takes ``STEP_SLEEP[k]`` seconds longer over step k; returns
    (the sleep, the logged step time, the logged wait for its results) per step."""
    def patch(trainer):
        train_step = trainer.engine.train_step

        def slowed(micro, lr):
            time.sleep(STEP_SLEEP[trainer.state.step + 1])  # the step counter moves once the step is queued
            return train_step(micro, lr)
        trainer.engine.train_step = slowed
    _train(overrides, 1, prepare=patch)
    return [(STEP_SLEEP[row["step"]], row["step_time_s"], row["host_wait_s"])
            for row in read_metrics(os.path.join(run_dir, "metrics.jsonl"))]


def _stop_at_third_check(run_dir, overrides):
    """Train one process whose stop check says "time is up" the third time it is asked; returns the
    steps logged and the checkpoints saved."""
    checks = []

    def agree(preempted, late):
        checks.append(1)
        return [preempted, len(checks) >= 3]

    def patch(trainer):
        trainer._agree = agree
    _train(overrides, 1, prepare=patch)
    steps = [row["step"] for row in read_metrics(os.path.join(run_dir, "metrics.jsonl"))]
    return steps, step_dirs(os.path.join(run_dir, "checkpoints"))


@pytest.fixture(scope="module")
def layouts(data_prefix, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("runs"))
    out = run_world(8, _world8, data_prefix, root, timeout=900)[0]
    out.update(run_world(1, _world1, data_prefix, root, timeout=300)[0])
    return out


def _close(a, b, tol=2e-4):
    return len(a) == len(b) and all(abs(x - y) <= tol * abs(y) for x, y in zip(a, b))


def test_loss_falls(layouts):
    losses = layouts["single"]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.3, losses


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tp2_pp2_dp2_matches_one_process(layouts, stage):
    assert _close(layouts[f"stage{stage}"], layouts["single"]), (layouts[f"stage{stage}"], layouts["single"])


def test_each_step_is_timed_by_its_own_work(layouts):
    """On a CPU a step is computed while it is queued, and the trainer queues the next step before it
    reads this one: a step's logged time is its own work, not the next step's, and a step the run
    pauses after (step 3 saves) is not logged as taking no time. Its results are ready as it is read:
    the host's wait for them is not the step's own time (planted: counted from its queueing)."""
    times = layouts["step_times"]
    assert len(times) == 6, times
    for sleep, seconds, wait in times:
        assert sleep <= seconds < sleep + 1.1, times  # the rest of a step takes 0.1-0.2 s on an idle machine
        assert 0 <= wait < 1.0, times


def test_a_token_budget_ends_at_the_step_that_reaches_it(layouts):
    assert layouts["tokens2"] == [1, 2], layouts["tokens2"]  # exactly two batches: no third step
    assert layouts["tokens1.5"] == [1, 2], layouts["tokens1.5"]  # a partial batch is a whole step


def test_the_last_step_is_not_saved_when_the_exit_save_is_off(layouts):
    """4 steps, a checkpoint every 2, checkpoint.save_on_exit false: step 4 is the last step, whose
    save is the exit save's business, and that is off."""
    assert layouts["last_save"] == ["step_0000002"], layouts["last_save"]


def test_each_step_trains_at_its_own_learning_rate(layouts):
    from megazero.config.schema import OptimizerConfig, ScheduleConfig, TrainConfig
    from megazero.training_schedules import build_lr_schedule

    lr = build_lr_schedule(OptimizerConfig(lr=3e-3, min_lr=3e-4), ScheduleConfig(warmup_steps=2, decay_steps=STEPS),
                           TrainConfig(train_steps=STEPS))
    assert [pytest.approx(lr(step)) for step, _ in layouts["lrs"]] == [value for _, value in layouts["lrs"]]
    assert layouts["lrs"][0][1] == pytest.approx(1.5e-3)  # half the peak, after the first of two warm-up steps


def test_a_batch_ramp_up_trains_the_smaller_batches_first(layouts):
    # 8 samples a step until 32 are consumed, then the full 16
    assert layouts["ramp_tokens"] == [8 * 32] * 4 + [16 * 32], layouts["ramp_tokens"]


def test_an_evaluation_averages_its_batches(layouts):
    logged, expected = layouts["eval2"]
    assert logged == [pytest.approx(expected, rel=1e-6)], (logged, expected)


def test_a_stop_just_after_a_periodic_save_does_not_save_the_step_again(layouts):
    assert layouts["stop_saved"] == [4], layouts["stop_saved"]


def test_a_checkpoint_directory_without_room_is_refused_before_the_first_step(layouts):
    """A small model's checkpoint is sized in KiB, not rounded to "0.0 GiB". Every rank raises rank 0's
    line, so it is marked for rank 0 alone to print."""
    assert re.search(r"checkpoints: 1 B free, a checkpoint needs about \d+\.\d [KM]iB; free space or set "
                     r"checkpoint.save_dir", layouts["no_room"] or ""), layouts["no_room"]
    assert layouts["no_room_agreed"]


def test_a_resume_hashes_each_file_it_reads_once(layouts):
    """The trainer checks the files it will load before loading (``files_to_load``) and hands that plan
    to the load, which then neither hashes them again nor reads the shard's description again
    (planted: the plan not passed on, which hashes the index and rank file twice)."""
    hashed = layouts["resume_hashed"]
    assert "rank_00000.safetensors" in hashed and len(hashed) == len(set(hashed)), hashed


def test_a_resume_keeps_the_skip_counters_and_knows_it_is_saved(layouts):
    step, skipped, bad_in_row, unsaved = layouts["counted"]
    assert (step, skipped, bad_in_row) == (4, 2, 2), layouts["counted"]
    assert unsaved == "nothing: step 4 is saved", unsaved


def test_profile_steps_write_one_trace_of_the_window(layouts):
    """``logging.profile_steps [2, 3]`` of 4 steps, queued one ahead: one whole trace file (no partial
    left), holding the steps' host operations (a forward's matrix products, the optimizer's update)
    and no other step's: step 4 is not queued before step 3 is read."""
    assert layouts["profile_files"] == ["rank0_steps2-3.json.gz"]
    ops = {str(name) for _, name in layouts["profile_ops"]}
    assert {"aten::mm", "aten::addmm"} & ops and any("adam" in name.lower() for name in ops), sorted(ops)[:50]
    steps = sorted(name for cat, name in layouts["profile_ops"]
                   if cat == "user_annotation" and str(name).startswith("megazero step "))
    assert steps == ["megazero step 2", "megazero step 3"], steps


def test_every_step_reports_how_long_the_host_waited_for_it(layouts):
    waits = layouts["host_wait"]
    assert len(waits) == 4 and all(isinstance(w, float) and 0 <= w < 60 for w in waits), waits


@pytest.mark.parametrize("run", ["reshard_dp4", "reshard_single"])
def test_resharded_resume_continues_the_curve(layouts, run):
    resumed = layouts[run]
    assert len(resumed) == STEPS - 3  # metrics.jsonl of a fresh run dir holds the resumed steps only
    assert _close(resumed, layouts["stage1"][3:]), (resumed, layouts["stage1"][3:])


# --- the real command under torchrun: kill -9 and SIGTERM ---------------------------------------

def _launch(config_path: str, steps: int, nproc: int = 2) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "megazero.cli", "train", config_path, "--train.train_steps", str(steps)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _write_config(path, prefix, run_dir, save_interval):
    cfg = load_config(None, _overrides(prefix, run_dir, pp=2, steps=40, extra=(
        "--checkpoint.save_interval", str(save_interval))))
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=None))
    path.write_text(yaml.safe_dump(dataclasses.asdict(cfg)))
    return str(path)


def _signal_tree(pid: int, sig: int) -> None:
    """Signal a process and all its descendants at once (torchrun starts workers in their own sessions,
    so a process-group signal would miss them), as a node failure or a scheduler would."""
    pids, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        for task in os.listdir(f"/proc/{parent}/task") if os.path.exists(f"/proc/{parent}/task") else []:
            with open(f"/proc/{parent}/task/{task}/children") as f:
                children = [int(c) for c in f.read().split()]
            pids += children
            frontier += children
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def _wait_for(predicate, proc, timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


FIELDS = ("step", "loss", "lr", "grad_norm", "consumed_samples")


@pytest.mark.slow  # the same launch is killed at two moments in CI by tests/test_fault_injection.py
def test_kill_minus_nine_then_resume_is_exact(data_prefix, tmp_path):
    steps = 24
    whole = _write_config(tmp_path / "whole.yaml", data_prefix, str(tmp_path / "whole"), 8)
    proc = _launch(whole, steps)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    reference = read_metrics(tmp_path / "whole" / "metrics.jsonl")

    killed_cfg = _write_config(tmp_path / "killed.yaml", data_prefix, str(tmp_path / "killed"), 8)
    ckpts = tmp_path / "killed" / "checkpoints"
    proc = _launch(killed_cfg, steps)
    reached = _wait_for(lambda: latest_checkpoint(ckpts) is not None, proc)
    _signal_tree(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert reached, "the run ended before its first checkpoint; nothing to resume"
    saved_step = json.loads((latest_checkpoint(ckpts) / "COMPLETE").read_text())["step"]
    assert saved_step < steps

    proc = _launch(killed_cfg, steps)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "resumed from" in out, out
    resumed = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, steps + 1))
    for a, b in zip(resumed[saved_step:], reference[saved_step:]):
        assert {k: a[k] for k in FIELDS} == {k: b[k] for k in FIELDS}


def test_sigterm_saves_a_loadable_checkpoint(data_prefix, tmp_path):
    """SIGTERM to every process at once, as SLURM and Kubernetes send it, under megazero's torchrun
    (``python -m parallel.launch``, which the launch script runs): the save completes, one line says
    where, and the status is 75, not 0 (finished) nor torchrun's failure."""
    from parallel.launch import EXIT_STOPPED

    cfg = _write_config(tmp_path / "term.yaml", data_prefix, str(tmp_path / "term"), 0)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "parallel.launch", "--standalone", "--nproc_per_node", "2",
                             "-m", "megazero.cli", "train", cfg, "--train.train_steps", "100000"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics = tmp_path / "term" / "metrics.jsonl"
    assert _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, proc)
    _signal_tree(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED, out
    ckpt = latest_checkpoint(tmp_path / "term" / "checkpoints")
    assert ckpt is not None, out
    step = verify_checkpoint(ckpt)["step"]
    assert [line for line in out.splitlines() if "preempted" in line] == [
        f"megazero: preempted at step {step} by SIGTERM, saved to {ckpt}"], out


def test_repeated_nan_losses_stop_the_run_with_a_message(layouts):
    """The step the error names has its line in metrics.jsonl, after its two bad steps before, and so
    has the step queued behind it (planted: the error raised before that step was logged, and the
    step behind it lost, so the log ended a step short of what the error names)."""
    import re

    message, rows = layouts["diverge"], layouts["diverge_metrics"]
    assert message is not None and "NaN or inf for 3 steps in a row" in message, message
    last = int(re.search(r"\(to step (\d+)\)", message).group(1))
    assert [r["step"] for r in rows] == list(range(1, last + 2)), rows  # one step was queued behind it
    assert all(r["loss"] is None and r["skipped_steps"] >= 1 for r in rows[last - 3:]), rows


def test_evaluation_sees_the_weights_of_its_step(layouts):
    """The trainer queues each step before reading the last one's results; the step it evaluates
    must not be run ahead of, so its validation loss is the one a run ending there computes."""
    last, longer = layouts["evaluations"][3], layouts["evaluations"][STEPS]
    assert len(last) == 1 and last[0][0] == 3, last
    assert [step for step, _ in longer] == [3, 6, 9], longer
    assert longer[0] == last[0], (longer, last)
    assert layouts["evaluations"]["ahead3"] == longer  # queued three ahead, paused at each evaluation


def test_steps_queued_further_ahead_train_the_same_and_save_where_asked(layouts):
    """``train.steps_ahead 3``: the same losses, bit for bit, as one step ahead; the periodic saves of
    steps 4 and 8 (not run ahead of); and a stop seen before step 2 is queued still ends after step 1."""
    assert layouts["ahead3"] == layouts["single"]
    assert layouts["ahead3_checkpoints"] == ["step_0000004", "step_0000008"], layouts["ahead3_checkpoints"]
    assert layouts["late_ahead3"] == [1]
    # three ahead, the third check stops the run: steps 1-5 were queued by then, all are logged, and
    # the exit save holds step 5
    assert layouts["stop_mid_ahead3"] == ([1, 2, 3, 4, 5], ["step_0000005"]), layouts["stop_mid_ahead3"]


def test_a_stop_seen_before_the_next_step_is_queued_ends_the_run_there(layouts):
    """Stop requests are agreed on before each step is queued: a time limit already passed when step 2
    would be queued ends the run after step 1, with no step run ahead of it."""
    rows, checkpoints = layouts["late"]
    assert rows == [1] and "step_0000001" in checkpoints and "step_0000002" not in checkpoints, layouts["late"]


def test_the_profiled_window_pauses_queueing_alike_on_every_rank(tmp_path, layouts):
    """The step before the window and its last step finish before the next is queued, on a rank that
    profiles and on one that does not: ranks agree on stopping once per round of queueing, so a
    pause on one rank only would leave the others waiting in that agreement (the 8-rank run with
    only rank 0 profiling would not finish)."""
    from megazero.profiling import StepProfiler

    for rank in (0, 1):
        profiler = StepProfiler([4, 6], [0], rank, str(tmp_path), torch.device("cpu"))
        assert [step for step in range(1, 10) if profiler.pauses_after(step)] == [3, 6]
    assert not StepProfiler(None, [0], 0, str(tmp_path), torch.device("cpu")).pauses_after(3)
    assert layouts["profiled_rank0_files"] == ["rank0_steps2-3.json.gz"]
    assert len(layouts["profiled_rank0"]) == 4


def test_a_damaged_rank_file_stops_every_rank_with_its_one_line(data_prefix, tmp_path):
    """A resume whose rank 1 file is damaged: rank 1 named it, rank 0 went on into the load's
    collectives and died on the lost connection with a traceback. Every rank checks the files it
    will read first, and all stop on the first rank's line, which rank 0 alone prints (planted: every
    rank printing it, a line per rank)."""
    cfg = _write_config(tmp_path / "bad.yaml", data_prefix, str(tmp_path / "bad"), 2)
    run_world(2, train_from_file, cfg, 2)
    ckpt = latest_checkpoint(tmp_path / "bad" / "checkpoints")
    damaged = ckpt / "rank_00001.safetensors"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    damaged.write_bytes(bytes(data))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, "-m", "parallel.launch", "--standalone", "--nproc_per_node", "2",
                           "-m", "megazero.cli", "train", cfg, "--train.train_steps", "4"], env=env,
                          capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    errors = [line for line in out.splitlines() if "megazero train: error:" in line]
    assert len(errors) == 1 and f"rank 1: {damaged}: sha256" in errors[0], out
    assert "Traceback" not in out and "Connection closed" not in out, out
