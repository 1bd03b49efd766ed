"""What a launch decides and says before it trains: settings that change nothing or cannot be met,
the tokenizer a shard records, a port in use, a wall-clock stop, indices too large for the host
(what a relaunch decides about its checkpoint is in ``test_launch_resume_checks.py``). Each case
runs the real ``megazero`` command line in this process on the files of ``tests/bad_input_files.py``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.indexed import IndexedDatasetWriter
from megazero.cli import main
from tests.bad_input_files import _model, _train, make_files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_files(tmp_path_factory.mktemp("inputs"))


def test_a_rendezvous_port_in_use_is_one_line(files, capsys, monkeypatch):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    try:
        code = main(_train(files))
    finally:
        taken.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"MASTER_PORT 127.0.0.1:{port} is already in use" in err[0] and "set MASTER_PORT" in err[0], err
    assert not list((files["root"] / "runs").glob("*/LOCK")), "the lock is released"


def test_a_warm_up_longer_than_the_run_is_said_at_its_start(files, capsys):
    """Legal (a smoke run of a full config), but the learning rate never reaches its peak: said once."""
    run = files["root"] / "short"
    assert main(["train", *_model(files["good"], str(run)), "--schedule.warmup_steps", "8"]) == 0
    out = capsys.readouterr().out
    assert "note: schedule.warmup_steps 8 is more than train.train_steps 2: the learning rate ends at 0.25" in out, out


def test_an_empty_validation_split_is_refused_only_where_the_evaluation_draws(files, capsys, tmp_path):
    """A dataset the evaluation's blend never samples may have no validation documents; one it samples
    may not: the check follows the blend, as the run's index build does. (Megatron's greedy rule gives
    the second dataset the blend's second sample whatever its weight, so the tiny one comes third.)"""
    tiny = str(tmp_path / "tiny_text_document")
    with IndexedDatasetWriter(tiny, np.uint16) as w:
        for _ in range(5):  # 969,30,1 of 5 documents leaves validation none
            w.add_document(np.arange(1, 40, dtype=np.uint16))
    check = ["--data.split", "969,30,1", "--train.eval_interval", "1", "--check"]
    good = files["good"]
    filler = files["recorded"]  # another dataset of 64 documents, to take the blend's second sample
    assert main(_train(files, "--data.blend", f"[[1.0, {good}], [1.0e-6, {filler}], [1.0e-6, {tiny}]]", *check)) == 0
    capsys.readouterr()
    assert main(_train(files, "--data.blend", f"[[1.0, {good}], [1.0e-6, {tiny}]]", *check)) == 2
    assert "tiny_text_document no documents for valid (5 documents in all)" in capsys.readouterr().err
    # one evaluation batch is 4 samples (global_batch_size), of which the second is the tiny one's
    blend = f"[[1.0, {good}], [1.0e-6, {tiny}]]"
    assert main(_train(files, "--data.blend", blend, *check, "--train.eval_steps", "1")) == 2
    assert "tiny_text_document no documents for valid" in capsys.readouterr().err


def test_a_dataset_of_weight_zero_needs_no_training_sample(files, capsys, tmp_path):
    """A dataset the blend gives weight 0 is never drawn for training: one too short for a single
    sample is accepted there, and refused at any positive weight."""
    short = str(tmp_path / "short_text_document")
    with IndexedDatasetWriter(short, np.uint16) as w:
        w.add_document(np.arange(1, 6, dtype=np.uint16))
    check = ["--check", "--train.eval_interval", "0"]
    assert main(_train(files, "--data.blend", f"[[1.0, {files['good']}], [0, {short}]]", *check)) == 0, \
        capsys.readouterr().err
    capsys.readouterr()
    assert main(_train(files, "--data.blend", f"[[1.0, {files['good']}], [0.5, {short}]]", *check)) == 2
    err = capsys.readouterr().err
    assert "model.seq_length: a sample of 16 needs 16+1 tokens" in err and "short_text_document's train" in err, err


def test_tokens_and_steps_together_are_refused_for_a_run_only():
    """The refusal is preflight's, not the config's: `convert` re-validates the config a checkpoint
    records, and a checkpoint of a run that set both (before the refusal) must still reshard."""
    import dataclasses

    from megazero.config import Config, resolve_config
    from megazero.preflight import _stop_problems

    cfg = Config()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, train_tokens=1000))
    assert resolve_config(cfg, 1).train.train_tokens == 1000
    assert _stop_problems(cfg) and not _stop_problems(dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, train_steps=None)))


def test_a_run_whose_sample_index_outgrows_the_host_memory_is_refused(monkeypatch):
    """The index of a run's samples takes INDEX_BYTES_PER_SAMPLE bytes a sample: a run whose index
    fits the host's memory exactly passes, one a sample longer is refused (planted: a thousand times
    the memory allowed, passed: the only other case asks for millions of times more)."""
    from data_pipeline.gpt_samples import INDEX_BYTES_PER_SAMPLE
    from megazero.config import Config
    from megazero.preflight import _index_problems

    cfg = Config()  # 100 steps of 16 samples
    pages = {"SC_PAGE_SIZE": INDEX_BYTES_PER_SAMPLE, "SC_PHYS_PAGES": 1600}
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])
    assert _index_problems(cfg) == []
    pages["SC_PHYS_PAGES"] = 1599
    assert _index_problems(cfg)[0].startswith("train.train_steps: 100 steps of train.global_batch_size 16 are 1,600 "
                                              "samples, whose index needs about")


def test_an_evaluation_whose_sample_index_outgrows_the_host_memory_is_refused(files, capsys):
    """The validation index is built for ``train.eval_steps`` batches like the training one for the
    run's: ``--check`` with an eval_steps typed with too many zeros ended in numpy's allocation
    traceback (blending the evaluation's samples); it is one line naming the field now, and nothing
    is said with evaluation off. (Planted: the validation index left out of the check.)"""
    args = [*_train(files, "--check"), "--train.eval_interval", "2"]
    assert main([*args, "--train.eval_steps", "1e12"]) == 2
    err = capsys.readouterr().err
    assert "train.eval_steps: 1000000000000 batches of " in err and "whose index needs about" in err, err
    assert "Traceback" not in err
    assert main([*args, "--train.eval_steps", "1e12", "--train.eval_interval", "0"]) == 0, capsys.readouterr().err


def test_a_rotary_base_is_no_change_to_a_model_of_learned_positions(files, capsys):
    """``model.rope_theta`` shapes nothing where positions are learned: a resume that sets another one
    is the same model and is accepted, while one that switches to rotary embeddings is not."""
    resume = _train(files, "--checkpoint.load", files["ckpt"], "--check")
    assert main([*resume, "--model.rope_theta", "500000"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main([*resume, "--model.position_embedding", "rope"]) == 2
    assert "different model (model.position_embedding)" in capsys.readouterr().err


def test_a_setting_that_changes_nothing_is_said_at_the_start(files, capsys):
    """`parallel.recompute_every` without full recompute was accepted and ignored without a word."""
    argv = ["train", *_model(files["good"], str(files["root"] / "runs" / "noted")), "--check"]
    assert main([*argv, "--parallel.recompute_every", "3"]) == 0
    assert "note: parallel.recompute_every 3 applies to parallel.recompute full only; with 'none'" in \
        capsys.readouterr().out
    assert main([*argv, "--data.blend_root", "shared/data"]) == 0  # data.blend's paths are not under it
    assert "note: data.blend_root shared/data applies to data.blend_preset only" in capsys.readouterr().out


def test_a_wall_clock_stop_saves_even_without_save_on_exit(files, capsys):
    """`train.max_wall_seconds` promises a save, as a preemption does; with `save_on_exit` false the
    stop said "saving" and wrote nothing, and the steps trained were lost. A run that can save only on
    those stops is told so at its start. With steps left the run is stopped, not finished: status 75,
    as after a signal, so a batch script requeues it (it exited 0 and said "finished", and a job whose
    limit came before SLURM's warning ended with its steps untrained; planted: status 0)."""
    run = files["root"] / "wall"
    argv = ["train", *_model(files["good"], str(run)), "--checkpoint.save_on_exit", "false"]
    assert main([*argv, "--train.max_wall_seconds", "1e-9"]) == 75
    out = capsys.readouterr().out
    assert "note: checkpoint.save_on_exit is false and checkpoint.save_interval 0" in out, out
    assert "recompute_every" not in out
    assert "for the wall-clock limit (train.max_wall_seconds); saving" in out, out
    saved = run / "checkpoints" / "step_0000001"
    assert saved.is_dir() and "finished" not in out, out
    assert f"megazero: stopped at step 1 by the wall-clock limit (train.max_wall_seconds), saved to {saved}" in out


@pytest.mark.parametrize("module, slowed", [("megazero.trainer", "build_datasets"),
                                            ("megazero.preflight", "check_run")])
def test_the_wall_clock_limit_counts_the_start_up(files, capsys, monkeypatch, module, slowed):
    """`train.max_wall_seconds` counts from the command's start, as Megatron's --exit-duration-in-mins
    from the process's: a start-up (here building the sample indices, or the checks before the
    process group starts, which scan every shard at scale) that takes longer than the limit stops
    the run after its first step. The clock started with the training loop, so a limit sized to a
    job's allocation was overrun by the start-up (minutes at scale), and this run trained to the end."""
    import importlib
    import time

    owner = importlib.import_module(module)
    original = getattr(owner, slowed)

    def slow(*args, **kwargs):
        time.sleep(1.5)
        return original(*args, **kwargs)
    monkeypatch.setattr(owner, slowed, slow)
    run = files["root"] / f"wall-start-{slowed}"
    assert main(["train", *_model(files["good"], str(run)), "--train.train_steps", "5",
                 "--train.max_wall_seconds", "1"]) == 75
    out = capsys.readouterr().out
    assert "stopping at step 1 for the wall-clock limit (train.max_wall_seconds); saving" in out, out


def test_a_shard_records_its_tokenizer_through_preprocess_and_merge(files, capsys):
    """What the tokenizer checks compare with: preprocessing records the tokenizer's digest beside the
    shard, a merge carries it over, and a run with that tokenizer passes."""
    from data_pipeline.shard_origin import read_origin, tokenizer_identity
    from data_pipeline.tokenizer import load_tokenizer

    tok, out = str(files["root"] / "tokenizer.json"), files["root"] / "recorded_out"
    made = [str(out / name) for name in ("a", "b")]
    for prefix in made:
        assert main(["preprocess", "--input", str(files["root"] / "whole.jsonl.gz"), "--tokenizer", tok,
                     "--output-prefix", prefix, "--no-progress"]) == 0
    merged = str(out / "merged_text_document")
    assert main(["preprocess", "--merge", *(f"{p}_text_document" for p in made), "--output-prefix", merged]) == 0
    assert read_origin(merged) == read_origin(f"{made[0]}_text_document") == tokenizer_identity(load_tokenizer(tok))
    capsys.readouterr()
    assert main(_train(files, "--data.tokenizer", tok, "--check", prefix=merged)) == 0, capsys.readouterr().err
    folder = files["root"] / "tokenizer_folder"  # a folder holding tokenizer.json is a tokenizer too
    folder.mkdir()
    shutil.copy(tok, folder / "tokenizer.json")
    assert main(["preprocess", "--input", str(files["root"] / "good.jsonl"), "--tokenizer", str(folder),
                 "--output-prefix", str(out / "f"), "--no-progress"]) == 0
    assert read_origin(str(out / "f_text_document")) == read_origin(merged)
    assert main(_train(files, "--data.tokenizer", str(folder), "--check", prefix=merged)) == 0


def test_a_damaged_tokenizer_record_is_one_line_at_check(files, capsys, tmp_path):
    """The data scan reads each shard's record again after the tokenizer check has reported a damaged
    one; it raised there, so `train --check` ended in a traceback instead of the report."""
    prefix = str(tmp_path / "shard")
    shutil.copy(files["good"] + ".bin", prefix + ".bin")
    shutil.copy(files["good"] + ".idx", prefix + ".idx")
    Path(prefix + ".tokenizer.json").write_text("{}")
    capsys.readouterr()
    assert main(_train(files, "--check", prefix=prefix)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "shard.tokenizer.json: damaged record of the shard's tokenizer" in err, err


def test_a_logger_without_its_package_is_refused_before_the_run(files, capsys):
    """``--check`` said "config ok" and the run stopped once its model was built."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here")
    assert main(_train(files, "--logging.tensorboard", "true", "--check")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "logging.tensorboard: is on but the tensorboard package is not installed" in err[0], err


def test_the_epoch_check_skips_what_the_run_does_not_sample(files, tmp_path):
    """A blend entry of weight 0, or a shard that cannot be opened (its own check names it), neither
    hangs nor raises in the resume check (an empty dataset once looped forever looking for its epochs)."""
    from megazero.config import load_config
    from megazero.resume_checks import _epochs_change

    cfg = load_config(None, _model(files["good"], str(tmp_path))[:-2])
    assert _epochs_change(files["good"], 0.0, cfg, 4, 4000) is False
    assert _epochs_change(str(tmp_path / "absent"), 1.0, cfg, 4, 4000) is False
    assert _epochs_change(files["good"], 1.0, cfg, 4, 300) is False  # 319 samples an epoch
    assert _epochs_change(files["good"], 1.0, cfg, 4, 320) is True


def test_check_refuses_a_recompute_the_engine_would_refuse(files, capsys, monkeypatch):
    """Recomputing tensor-parallel modules that draw dropout, compiled, was refused only once the
    engine built its blocks, after the process group and data had started: `train --check` passed it."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    argv = ["train", *_model(files["good"], str(files["root"] / "runs" / "replay")), "--check", "--parallel.tp", "2",
            "--parallel.recompute", "full", "--model.dropout", "0.1"]
    assert main([*argv, "--train.compile", "true"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.recompute: recomputing tensor-parallel modules with dropout" in err[0], err
    assert main([*argv, "--train.compile", "false"]) == 0
    assert main(argv) == 0  # train.compile null: off on this CPU, as the engine resolves it


def test_check_resolves_compile_for_the_gpus_it_would_run_on(files, capsys, monkeypatch):
    """With train.device auto on a machine with GPUs, train.compile null resolves to on, as the engine
    resolves it there: the recompute it would refuse is refused by --check too (the CPU-only answer
    passed it). The GPUs are faked, so the memory check, which reads their size, is left out."""
    import torch

    from megazero import preflight

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(preflight, "_memory_problems", lambda cfg, ranks_per_node: [])
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    argv = ["train", *_model(files["good"], str(files["root"] / "runs" / "replay_auto")), "--check",
            "--parallel.tp", "2", "--parallel.recompute", "full", "--model.dropout", "0.1", "--train.device", "auto"]
    assert main(argv) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.recompute: recomputing tensor-parallel modules with dropout" in err[0], err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_a_recompute_on_a_device_not_here_is_said_once_as_the_device(files, capsys, monkeypatch):
    """Where train.device names CUDA and none is visible, the device is the one problem to say: the
    recompute check, which resolves train.compile for that device, is not asked as well."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    argv = ["train", *_model(files["good"], str(files["root"] / "runs" / "replay_nocuda")), "--check",
            "--parallel.tp", "2", "--parallel.recompute", "full", "--model.dropout", "0.1", "--train.compile", "true",
            "--train.device", "cuda"]
    assert main(argv) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.device: is 'cuda' but no CUDA device is visible here" in err[0], err


def test_sample_indices_that_cannot_be_written_are_one_line(files, tmp_path, monkeypatch):
    """The index cache fails to take the indices (a full disk, or read-only data whose largest-id
    fact preflight had cached before): an OSError other than a missing file escaped the data's
    errors as a traceback on every rank; it is one line naming data.cache_dir."""
    import errno

    from megazero.config import load_config
    from megazero.data import build_datasets, train_samples
    from megazero.errors import ConfigError

    cfg = load_config(None, [*_model(files["good"], str(tmp_path / "run")), "--data.cache_dir", str(tmp_path / "c")])

    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(np, "save", full)
    with pytest.raises(ConfigError, match=rf"^data.cache_dir: the sample indices cannot be written \({tmp_path / 'c'}: "
                                          r"No space left on device\); free space there"):
        build_datasets(cfg, train_samples(cfg))
    monkeypatch.undo()
    real_memmap = np.memmap

    def unreadable(path, *args, **kwargs):  # the data, not the cache: not reported as the cache's
        if str(path).endswith(".bin"):
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real_memmap(path, *args, **kwargs)

    monkeypatch.setattr(np, "memmap", unreadable)
    with pytest.raises(ConfigError, match=r"^data: \[Errno 5\] Input/output error: .*\.bin"):
        build_datasets(load_config(None, [*_model(files["good"], str(tmp_path / "run2")),
                                          "--data.cache_dir", str(tmp_path / "c2")]), train_samples(cfg))


def test_an_evaluation_reading_its_split_more_than_once_is_noted(files, capsys):
    """An evaluation of more samples than the validation split holds reads the same ones again (the
    last time in part): said once at the start, with the fields that size it; nothing is said where
    the split holds them. (Planted: no note.)"""
    args = [*_train(files, "--data.split", "90,10,0", "--train.eval_interval", "2", "--train.train_steps", "2"),
            "--logging.run_dir", str(files["root"] / "runs" / "evaluated")]
    assert main([*args, "--train.eval_steps", "20"]) == 0
    out = capsys.readouterr().out
    assert (f"megazero: an evaluation reads 80 samples of {files['good']}'s validation split, which holds 29: each "
            "is read about 2.8 times (train.eval_steps 20 x train.global_batch_size 4); fewer eval_steps read each "
            "once") in out, out
    assert main([*args, "--train.eval_steps", "7", "--logging.run_dir", str(files["root"] / "runs" / "once")]) == 0
    assert "an evaluation reads" not in capsys.readouterr().out


def _offloaded_held(rank, world_size):
    """What a one-rank engine with the optimizer offloaded holds on the host, and the planner's count."""
    import torch

    from megazero.config import load_config, resolve_config
    from megazero.engine import Engine
    from megazero.planner.memory import offloaded_bytes
    from parallel.topology import RankGrid, Topology

    cfg = load_config(None, ["--model.num_layers", "2", "--model.hidden_size", "48", "--model.num_heads", "4",
                             "--model.vocab_size", "100", "--model.seq_length", "16", "--train.device", "cpu",
                             "--zero.offload_optimizer", "true", "--zero.stage", "1"])
    cfg = resolve_config(cfg, world_size)
    held = Engine(cfg, Topology(RankGrid(tp=1, pp=1, dp=1)), torch.device("cpu")).optimizer.memory_bytes()
    return held["master"] + held["optimizer"], offloaded_bytes(cfg), cfg


def test_an_offloaded_optimizer_larger_than_the_host_is_refused(monkeypatch):
    """The offloaded master, its gradient and the moments live in host memory, which the device's
    formula leaves out: a layout that fit its GPUs by offloading passed --check on hosts too small
    for it (planted: no host check). The count is what a real engine holds (its gradient copy is the
    master's size; planted: the copy left out, 25% short), and a node's ranks add up."""
    from megazero.preflight import _offload_problems
    from tests.distributed import run_world

    states, counted, cfg = run_world(1, _offloaded_held)[0]
    master = states / 3  # the master and its two moments, each a shard of fp32
    assert counted == pytest.approx(states + master, rel=0.01)  # the shard's alignment padding aside
    pages = {"SC_PAGE_SIZE": 1, "SC_PHYS_PAGES": int(counted) * 2}
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])
    assert _offload_problems(cfg, 2) == []
    pages["SC_PHYS_PAGES"] -= 1
    (problem,) = _offload_problems(cfg, 2)
    assert problem.startswith("zero.offload_optimizer: the optimizer states offloaded by 2 rank(s) of a node need "
                              "about"), problem
