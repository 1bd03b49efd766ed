"""What a run trains and keeps, checked against values worked out apart from the trainer.

* Each step trains the global batch that starts where the steps before it stopped consuming, also
  while a batch ramp-up changes the batch size from step to step.
* The training and validation samples come from their split's documents, as many as the run reads;
  a shard whose index cannot be read is left out of the recorded digests, the others kept.
* An evaluation reads whole global batches, also during a batch ramp-up.
* The last step is saved on exit even when a periodic save came before it.
* fp16 overflows, skipped while the loss scale comes down, are not taken for divergence.
* Ctrl-C as a step is queued still logs the step in flight before it.
* A stop signal saves the step it stopped at, with ``checkpoint.save_on_exit`` false, and the
  command exits 75 (preempted).
* A signal that reaches one rank of two stops both at the same step, and both name it.
* The free space asked of the checkpoint directory before the first step is one checkpoint's, every
  rank's shard; the memory line printed at the start is the most loaded rank's, and the start-up
  line counts the nodes the launcher gives.
* The config a run records holds the pipeline split that trains, a kept one said so.

The runs are the real ``megazero train`` command (in this process) or real trainers on a gloo world.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

from megazero.checkpoint import verify_checkpoint
from megazero.cli import main
from megazero.metrics import read_metrics
from parallel.launch import EXIT_STOPPED
from tests.distributed import run_world
from tests.test_trainer import VOCAB, step_dirs, write_arithmetic_shard

BATCH = 4


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    return write_arithmetic_shard(str(tmp_path_factory.mktemp("data") / "arith_text_document"), 200)


def _overrides(prefix: str, run_dir, steps: int, *extra: str) -> list[str]:
    return ["--model.num_layers", "2", "--model.hidden_size", "32", "--model.num_heads", "4",
            "--model.vocab_size", str(VOCAB), "--model.seq_length", "16", "--train.micro_batch_size", "2",
            "--train.global_batch_size", str(BATCH), "--train.train_steps", str(steps), "--train.device", "cpu",
            "--data.blend", f"[[1.0, {prefix}]]", "--data.split", "1", "--logging.run_dir", str(run_dir),
            "--logging.log_interval", "1", *extra]


def _record_steps(monkeypatch, on_step=None) -> list:
    """Record the tokens of every global batch the engine trains (``on_step(n)`` runs as the n-th
    step is queued)."""
    from megazero.engine import Engine

    batches, train_step = [], Engine.train_step

    def recorded(engine, microbatches, lr=None):
        batches.append(torch.cat([m["tokens"] for m in microbatches]))
        if on_step is not None:
            on_step(len(batches))
        return train_step(engine, microbatches, lr)
    monkeypatch.setattr(Engine, "train_step", recorded)
    return batches


def test_each_step_trains_the_samples_after_those_consumed(prefix, tmp_path, monkeypatch):
    """A ramp-up of 2 samples a step until 4 are consumed, then 4: steps 1-4 train samples 0-1, 2-3,
    4-7 and 8-11 of the training set, whose order the seed alone fixes."""
    from megazero.config import load_config, resolve_config
    from megazero.data import build_datasets, train_samples

    argv = _overrides(prefix, tmp_path / "run", 4, "--schedule.rampup_start_batch", "2",
                      "--schedule.rampup_increment", "2", "--schedule.rampup_samples", "4",
                      "--checkpoint.save_on_exit", "false")
    batches = _record_steps(monkeypatch)
    assert main(["train", *argv]) == 0
    cfg = resolve_config(load_config(None, argv), 1)
    train, _ = build_datasets(cfg, train_samples(cfg))
    expected = [np.stack([train[i] for i in range(start, end)])[:, :-1] for start, end in ((0, 2), (2, 4), (4, 8), (8, 12))]
    assert [b.tolist() for b in batches] == [e.tolist() for e in expected]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [row["consumed_samples"] for row in rows] == [2, 4, 8, 12], rows


def test_an_evaluation_during_a_batch_ramp_up_reads_whole_global_batches(prefix, tmp_path, monkeypatch):
    """Evaluations compare only over the same batches: while a ramp-up trains 2 samples a step, each
    still reads ``eval_steps`` global batches of 4, as every later one does."""
    from megazero.engine import Engine

    read, eval_loss = [], Engine.eval_loss

    def recorded(engine, microbatches):
        read.append(sum(m["tokens"].shape[0] for m in microbatches))
        return eval_loss(engine, microbatches)
    monkeypatch.setattr(Engine, "eval_loss", recorded)
    argv = _overrides(prefix, tmp_path / "run", 2, "--data.split", "8,2,0", "--train.eval_interval", "1",
                      "--train.eval_steps", "2", "--schedule.rampup_start_batch", "2", "--schedule.rampup_increment",
                      "2", "--schedule.rampup_samples", "4", "--checkpoint.save_on_exit", "false")
    assert main(["train", *argv]) == 0
    assert read == [BATCH] * 4, read  # two evaluations of two batches


def test_a_runs_datasets_hold_the_samples_it_reads_from_the_documents_of_their_split(prefix, tmp_path):
    """Validation draws eval_steps global batches from the validation documents alone, training from
    the training documents, and a token budget's indices hold the whole batch that reaches it.
    (Planted: the validation blend built from the training split, or for eval_steps micro-batches, or
    a budget's samples not rounded up to a batch; each passed every fast test, the first evaluating
    on text the model trains on, the second skipping every evaluation without a word.)"""
    from megazero.config import load_config, resolve_config
    from megazero.data import build_datasets, train_samples

    argv = _overrides(prefix, tmp_path / "run", 2, "--data.split", "8,2,0", "--train.eval_interval", "1",
                      "--train.eval_steps", "2", "--data.cache_dir", str(tmp_path / "cache"))
    cfg = resolve_config(load_config(None, argv), 1)
    train, valid = build_datasets(cfg, train_samples(cfg))
    assert (len(train), len(valid)) == (2 * BATCH, 2 * BATCH)
    assert set(train.datasets[0].document_index.tolist()) <= set(range(160))
    assert set(valid.datasets[0].document_index.tolist()) <= set(range(160, 200))
    budget = resolve_config(load_config(None, [*argv, "--train.train_steps", "null", "--schedule.decay_steps", "2",
                                               "--train.train_tokens", str(3 * BATCH * 16 // 2)]), 1)  # 1.5 batches
    assert len(build_datasets(budget, train_samples(budget))[0]) >= 2 * BATCH


def test_a_shard_whose_index_cannot_be_read_leaves_the_others_digested(prefix, tmp_path):
    """The shard digests a checkpoint records, and a resume compares, leave out a shard whose .idx
    cannot be read (its own check names it) and still hold every other: a resume then also names a
    shard rewritten since, in the same pass."""
    from data_pipeline.shard_files import idx_sha256
    from megazero.config import load_config
    from megazero.data import shard_digests

    cfg = load_config(None, ["--data.blend", f"[[1.0, {tmp_path / 'gone_text_document'}], [1.0, {prefix}]]"])
    assert shard_digests(cfg) == {os.path.realpath(prefix): idx_sha256(prefix)[0]}


def test_the_last_step_is_saved_on_exit_after_a_periodic_save(prefix, tmp_path):
    """3 steps, a checkpoint every 2: step 2's periodic save, then step 3's on exit, which a relaunch
    resumes from."""
    assert main(["train", *_overrides(prefix, tmp_path / "run", 3, "--checkpoint.save_interval", "2")]) == 0
    checkpoints = tmp_path / "run" / "checkpoints"
    assert step_dirs(checkpoints) == ["step_0000002", "step_0000003"]
    assert verify_checkpoint(checkpoints / "step_0000003")["step"] == 3


def test_fp16_overflows_with_finite_losses_are_no_divergence(prefix, tmp_path, capsys):
    """A loss scale set far too high overflows every fp16 gradient while the dynamic scaler lowers it:
    each such step is skipped, but its loss is finite, so three in a row under ``max_bad_steps`` 2
    still train on (the scaler stops the run at ``min_loss_scale``; only non-finite losses, or skips
    under bf16 or fp32, are divergence), and the last line counts them."""
    run = tmp_path / "run"
    assert main(["train", *_overrides(prefix, run, 3, "--precision.dtype", "fp16", "--precision.initial_loss_scale",
                                      "1e30", "--precision.hysteresis", "1", "--train.max_bad_steps", "2",
                                      "--checkpoint.save_on_exit", "false")]) == 0
    assert [row["skipped_steps"] for row in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    assert "megazero: finished at step 3 (12 samples, 3 skipped)" in capsys.readouterr().out.splitlines()


def test_a_step_that_fails_as_it_is_queued_leaves_the_step_before_it_logged(prefix, tmp_path, monkeypatch):
    """Ctrl-C while step 3 is queued, step 2 still in flight: step 2 trained, so its results are read
    and logged before the interrupt ends the command (130)."""
    def interrupt(n):
        if n == 3:
            raise KeyboardInterrupt
    _record_steps(monkeypatch, interrupt)
    run = tmp_path / "run"
    assert main(["train", *_overrides(prefix, run, 5, "--checkpoint.save_on_exit", "false")]) == 130
    assert [row["step"] for row in read_metrics(run / "metrics.jsonl")] == [1, 2]


def test_a_stop_signal_saves_its_step_even_with_the_exit_save_off(prefix, tmp_path, monkeypatch, capsys):
    """SIGTERM while step 2 is queued: step 2 finishes, is saved though ``save_on_exit`` is false,
    no step 3 is trained, and the command's status is 75."""
    _record_steps(monkeypatch, lambda n: n == 2 and os.kill(os.getpid(), signal.SIGTERM))
    run = tmp_path / "run"
    assert main(["train", *_overrides(prefix, run, 10, "--checkpoint.save_on_exit", "false")]) == EXIT_STOPPED
    assert [row["step"] for row in read_metrics(run / "metrics.jsonl")] == [1, 2]
    assert step_dirs(run / "checkpoints") == ["step_0000002"]
    assert f"preempted at step 2 by SIGTERM, saved to {run / 'checkpoints' / 'step_0000002'}" in capsys.readouterr().out


def test_a_stop_signal_in_the_last_step_is_a_finished_run(prefix, tmp_path, monkeypatch, capsys):
    """SIGTERM while the last of 3 steps is queued: the run has no steps left, so it is finished (status
    0, its checkpoint saved), not preempted with status 75, which a scheduler would requeue only for the
    relaunch to say there is nothing left to train."""
    _record_steps(monkeypatch, lambda n: n == 3 and os.kill(os.getpid(), signal.SIGTERM))
    run = tmp_path / "run"
    assert main(["train", *_overrides(prefix, run, 3, "--checkpoint.save_on_exit", "false")]) == 0
    assert step_dirs(run / "checkpoints") == ["step_0000003"]
    out = capsys.readouterr().out
    assert "stopping at step 3 for SIGTERM; saving" in out and "preempted at step" not in out, out


def _two_data_parallel_ranks(rank, world_size, prefix, root):
    """Two data-parallel ranks. First only rank 1 receives SIGUSR1, while its step 3 is queued; then
    only rank 1's disk is full when the run saves (its checkpoint writes fail with ENOSPC)."""
    import errno

    import torch.distributed as dist

    from megazero.checkpoint import CheckpointError
    from megazero.checkpoint.format import HashingWriter
    from megazero.config import load_config, resolve_config
    from megazero.startup import initialize
    from megazero.trainer import Trainer
    from parallel.launch import LaunchEnv

    def trainer_for(run: str, *extra: str) -> Trainer:
        cfg = resolve_config(load_config(None, _overrides(prefix, f"{root}/{run}", 10, *extra)), world_size)
        return Trainer(cfg, *initialize(cfg, LaunchEnv(rank, world_size, rank, world_size)))

    trainer = trainer_for("run", "--checkpoint.save_on_exit", "false")
    train_step = trainer.engine.train_step

    def step(microbatches, lr):
        if rank == 1 and trainer.state.step + 1 == 3:
            os.kill(os.getpid(), signal.SIGUSR1)
        return train_step(microbatches, lr)
    trainer.engine.train_step = step
    state = trainer.train()
    dist.barrier()
    signalled = (state.step, state.stopped_by, state.saved_to)

    trainer = trainer_for("full-disk", "--checkpoint.save_interval", "2")
    if rank == 1:
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")
        HashingWriter.write = write
    try:
        trainer.train()
        failed = None
    except CheckpointError as exc:
        failed = (str(exc), exc.agreed)
    dist.barrier()
    return signalled, failed


@pytest.fixture(scope="module")
def two_ranks(prefix, tmp_path_factory):
    root = tmp_path_factory.mktemp("two-ranks")
    return root, run_world(2, _two_data_parallel_ranks, prefix, str(root), timeout=240)


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(two_ranks):
    """The ranks agree on stopping before each step is queued: rank 1's signal, seen after step 3 is
    queued, stops both ranks after step 3, both name it, and the save of step 3 holds both ranks."""
    root, results = two_ranks
    saved = str(root / "run" / "checkpoints" / "step_0000003")
    assert [signalled for signalled, _ in results] == [(3, "SIGUSR1", saved), (3, "SIGUSR1", saved)], results
    files = verify_checkpoint(saved)["files"]
    assert {entry["rank"] for entry in files.values()} == {0, 1}, files


def test_a_save_failing_on_one_rank_is_one_agreed_line_with_that_ranks_reason(two_ranks):
    """Both ranks raise rank 1's own words (the full disk), marked agreed, so the launch prints it once
    (rank 0 had said only that rank 1 did not finish; rank 1 the reason; the launch printed both)."""
    root, results = two_ranks
    tmp = root / "full-disk" / "checkpoints" / "step_0000002.tmp"
    line = (f"{tmp}: rank 1 could not write its checkpoint files: no space left on device: free space, or lower "
            "checkpoint.keep_last where older checkpoints take it; the partial checkpoint was removed and the "
            "previous one, if any, is still the latest")
    assert [failed for _, failed in results] == [(line, True), (line, True)], results
    assert not (root / "full-disk" / "checkpoints").exists() or not step_dirs(root / "full-disk" / "checkpoints")


def test_the_room_asked_for_one_checkpoint_is_12_bytes_a_parameter(prefix, tmp_path, monkeypatch, capsys, two_stages):
    """A checkpoint holds the fp32 master weights and Adam's two moments: 12 bytes a parameter (a
    little more for the shard's padding), and its other files (``RANK_FILES_ALLOWANCE`` a rank). A
    directory with one byte less than that is refused before the first step; one with 13 a parameter
    more trains. Sharded over ranks, the room is still the whole checkpoint's, every rank's shard
    (planted: rank 0's shard alone)."""
    from megazero.trainer import RANK_FILES_ALLOWANCE
    import shutil

    from megazero.config import load_config, resolve_config
    from models.gpt import GPT

    argv = _overrides(prefix, tmp_path / "run", 1)
    cfg = resolve_config(load_config(None, argv), 1)
    params = sum(p.numel() for p in GPT(cfg.model, device="meta").parameters())
    usage = shutil.disk_usage
    for free, code in ((12 * params + RANK_FILES_ALLOWANCE - 1, 2), (13 * params + RANK_FILES_ALLOWANCE, 0)):
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(path)._replace(free=free))
        assert main(["train", *argv]) == code, capsys.readouterr().err
    assert "a checkpoint needs about" in capsys.readouterr().err
    # two pipeline stages hold a part of the optimizer each: the room asked is for both parts
    refusals = [refusal for _, refusal in two_stages]
    assert all(refusals) and "a checkpoint needs about" in refusals[0], refusals


def test_the_memory_line_is_the_most_loaded_ranks(two_stages):
    """At the start rank 0 prints one rank's ZeRO memory line, the most loaded rank's (rank 1's here,
    three blocks and the head against rank 0's one block), and the spread over the ranks."""
    said = two_stages[0][0]
    lines = [line for line in said.splitlines() if "model states" in line]
    assert lines[0].startswith("[rank 1] ZeRO-1 model states"), said
    assert lines[1].startswith("megazero: model states over 2 ranks: "), said


def test_the_start_up_line_counts_the_nodes_the_launcher_gives(two_stages):
    """The layout line counts nodes by the ranks the launcher starts on each (``LOCAL_WORLD_SIZE``), by
    which it also says whether tensor groups span nodes; not by the world's size."""
    said = two_stages[0][0]
    assert "megazero: tp1 x dp1 x pp2 = 2 ranks on 2 nodes; tp groups within nodes (cpu)" in said.splitlines(), said


@pytest.fixture(scope="module")
def two_stages(prefix, tmp_path_factory):
    """Trainers built on a two-stage pipeline of split [1, 3] over two nodes of one rank each, by rank:
    (what the start-up and the one with room to save printed, the refusal of one whose checkpoint
    directory lacks a byte of 12 a parameter)."""
    from megazero.config import load_config, resolve_config
    from models.gpt import GPT

    argv = [*_overrides(prefix, tmp_path_factory.mktemp("two-stages"), 1, "--parallel.pp", "2",
                        "--parallel.pipeline_split", "[1, 3]"), "--model.num_layers", "4"]
    params = sum(p.numel() for p in GPT(resolve_config(load_config(None, argv), 2).model, device="meta").parameters())
    return run_world(2, _start_two_stages, argv, 12 * params - 1, timeout=240)


def _start_two_stages(rank, world_size, argv, free):
    import contextlib
    import io
    import shutil

    from megazero.checkpoint import CheckpointError
    from megazero.config import load_config, resolve_config
    from megazero.startup import initialize
    from megazero.trainer import Trainer
    from parallel.launch import LaunchEnv

    cfg = resolve_config(load_config(None, argv), world_size)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        device, topology = initialize(cfg, LaunchEnv(rank, world_size, 0, 1))  # two nodes of one rank each
        Trainer(cfg, device, topology)
    usage = shutil.disk_usage
    shutil.disk_usage = lambda path: usage(path)._replace(free=free)
    try:
        Trainer(cfg, device, topology)
        refusal = None
    except CheckpointError as exc:
        refusal = str(exc)
    finally:
        shutil.disk_usage = usage
    return said.getvalue(), refusal


def _run_pipeline(rank, world_size, argv):
    """``megazero train``'s run on a two-rank pipeline: locks, checks, training, the config's record;
    its status and what it printed."""
    import contextlib
    import io

    from megazero.config import load_config, resolve_config
    from megazero.startup import start_run
    from parallel.launch import LaunchEnv

    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        status = start_run(resolve_config(load_config(None, argv), world_size),
                           LaunchEnv(rank, world_size, rank, world_size))
    return status, said.getvalue()


def test_the_config_record_holds_the_pipeline_split_that_trains(prefix, tmp_path):
    """A run saved with the split [1, 3] and resumed with none given keeps the checkpoint's split, and
    its config.yaml says so: the record is what trains (planted: the config as given, whose split was
    none, was written, so a relaunch from the record would have trained another split). The start says
    which split it keeps, against the default."""
    import yaml

    run = tmp_path / "run"
    base = [*_overrides(prefix, run, 1, "--parallel.pp", "2"), "--model.num_layers", "4"]
    saved = run_world(2, _run_pipeline, [*base, "--parallel.pipeline_split", "[1, 3]"], timeout=240)
    assert [status for status, _ in saved] == [0, 0]
    resumed = run_world(2, _run_pipeline, [*base, "--train.train_steps", "2"], timeout=240)
    assert [status for status, _ in resumed] == [0, 0]
    assert "megazero: keeping the checkpoint's pipeline split [1, 3] (the default is now " in resumed[0][1], resumed
    assert step_dirs(run / "checkpoints") == ["step_0000001", "step_0000002"]
    record = yaml.safe_load((run / "config.yaml").read_text())
    assert record["parallel"]["pipeline_split"] == [1, 3], record["parallel"]
