"""Checkpoint files: round trips on threads and on real gloo ranks, kill -9 mid-save, damage detection,
keep-last (the preemption flag that asks for the save is in ``test_preemption_handler.py``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from megazero.checkpoint import (
    CheckpointError, CheckpointWriter, latest_checkpoint, list_checkpoints, load_file,
    read_manifest, resolve_checkpoint, start_checkpoint, verify_checkpoint,
)
from tests.distributed import run_world

REPO = Path(__file__).resolve().parents[1]


def alone() -> None:
    """The barrier of a one-rank world."""


def shard(rank: int, step: int) -> dict:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return {"weight": torch.randn(64, 16, generator=gen), "step": step, "rng": torch.get_rng_state(),
            "nested": {"bias": [torch.full((3,), float(rank)), (rank, "x")]}}


def assert_shard_equal(loaded: dict, expected: dict) -> None:
    assert torch.equal(loaded["weight"], expected["weight"])
    assert loaded["step"] == expected["step"]
    assert torch.equal(loaded["rng"], expected["rng"])
    assert torch.equal(loaded["nested"]["bias"][0], expected["nested"]["bias"][0])
    assert loaded["nested"]["bias"][1] == list(expected["nested"]["bias"][1])  # tuples come back as lists


def save_on_threads(root: Path, world: int, step: int, async_save: bool, names=None, keep_last: int = 3) -> list:
    """Save ``step`` from ``world`` ranks run as threads; returns each rank's exception or None."""
    files = [{names[rank] if names else f"model/rank{rank:02d}.pt": shard(rank, step)} for rank in range(world)]
    return save_rank_files(root, step, files, async_save, keep_last=keep_last, meta={"layout": "dp" + str(world)})


def save_rank_files(root: Path, step: int, files_by_rank: list[dict], async_save: bool = False, keep_last: int = 3,
                    meta=None, gathers: bool = False) -> list:
    """Save ``step`` with one thread per rank writing its ``files_by_rank`` entry; returns each rank's
    exception or None. The barrier times out rather than hangs when a rank is left waiting;
    ``gathers`` gives the writers a gather across the threads, as the trainer gives its ranks one."""
    world = len(files_by_rank)
    barrier = threading.Barrier(world, timeout=30)
    errors: list = [None] * world
    slots: list = [None] * world

    def gather(rank: int, value) -> list:
        slots[rank] = value
        barrier.wait()
        everyone = list(slots)
        barrier.wait()  # all have read before any writes the next round
        return everyone

    def rank_main(rank: int) -> None:
        writer = CheckpointWriter(root, rank=rank, world_size=world, barrier=barrier.wait,
                                  keep_last=keep_last, async_save=async_save,
                                  gather=(lambda value: gather(rank, value)) if gathers else None)
        try:
            writer.save(step, files_by_rank[rank], meta=meta)
            writer.wait()
        except Exception as e:  # noqa: BLE001 - returned for the test to inspect
            errors[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


# --- round trips --------------------------------------------------------------------------------

@pytest.mark.parametrize("async_save", [False, True])
def test_single_rank_round_trip(tmp_path, async_save):
    writer = CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone, async_save=async_save)
    files = {"model.pt": shard(0, 5), "optim/state.pt": {"exp_avg": torch.ones(7)}}
    writer.save(5, files, meta={"consumed_samples": 320})
    assert writer.wait() == (tmp_path / "step_0000005" if async_save else None)  # sync: nothing pending
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt == tmp_path / "step_0000005"
    manifest = read_manifest(ckpt)
    assert manifest["step"] == 5 and manifest["meta"] == {"consumed_samples": 320}
    assert set(manifest["files"]) == {"model.pt", "optim/state.pt"}
    assert_shard_equal(load_file(ckpt, "model.pt"), files["model.pt"])
    assert torch.equal(load_file(ckpt, "optim/state.pt", manifest=manifest)["exp_avg"], torch.ones(7))
    assert (tmp_path / "latest").read_text().strip() == "step_0000005"


@pytest.mark.parametrize("async_save", [False, True])
def test_four_ranks_write_in_parallel_and_rank0_commits(tmp_path, async_save):
    assert save_on_threads(tmp_path, 4, 3, async_save) == [None] * 4
    ckpt = latest_checkpoint(tmp_path)
    manifest = verify_checkpoint(ckpt)
    assert manifest["world_size"] == 4 and manifest["meta"] == {"layout": "dp4"}
    assert {name: e["rank"] for name, e in manifest["files"].items()} == {f"model/rank{r:02d}.pt": r for r in range(4)}
    for r in range(4):
        assert_shard_equal(load_file(ckpt, f"model/rank{r:02d}.pt"), shard(r, 3))
    assert not list(tmp_path.glob("*.tmp"))


def test_async_save_snapshots_before_training_continues(tmp_path, monkeypatch):
    """The writing thread is held until the next optimizer step has changed the tensor, so the file
    can only hold the saved values if ``save`` copied them first. (Planted: a CPU tensor kept by
    reference, which passed while the thread happened to finish before the step.)"""
    from megazero.checkpoint import serialization

    stepped, write = threading.Event(), serialization.write
    monkeypatch.setattr(serialization, "write", lambda obj, f: (stepped.wait(30), write(obj, f)))
    weight = torch.zeros(1000)
    writer = CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone, async_save=True)
    writer.save(1, {"model.pt": {"w": weight}})
    weight.add_(1.0)  # the next optimizer step, while the file is still to be written
    stepped.set()
    assert writer.wait() == tmp_path / "step_0000001"
    assert torch.equal(load_file(tmp_path / "step_0000001", "model.pt")["w"], torch.zeros(1000))


def test_async_save_writes_only_after_the_device_copies_land(tmp_path, monkeypatch):
    """On a GPU the snapshot's device-to-host copies are non-blocking, so the writing thread may start
    only once the device has finished them, or it hashes and writes host buffers still being filled.
    Without a GPU here, a stand-in device records its synchronize beside the thread's write.
    (Planted: the thread started before, or without, waiting for the device.)"""
    from megazero.checkpoint import serialization

    events, write = [], serialization.write
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: events.append("synchronize"))
    monkeypatch.setattr(serialization, "write", lambda obj, f: (events.append("write"), write(obj, f)))

    class Thread(threading.Thread):
        def start(self):
            events.append("thread")
            super().start()

    monkeypatch.setattr(threading, "Thread", Thread)
    writer = CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone, async_save=True)
    writer.save(1, {"model.pt": {"w": torch.ones(3)}})
    writer.wait()
    assert events == ["synchronize", "thread", "write"]


def test_async_save_is_committed_only_by_wait(tmp_path):
    writer = CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone, async_save=True)
    writer.save(1, {"model.pt": {"w": torch.ones(3)}})
    assert (writer.pending_step, writer.committed_step) == (1, None)
    writer.wait()
    writer.save(2, {"model.pt": {"w": torch.ones(3)}})
    assert latest_checkpoint(tmp_path).name == "step_0000001"  # step 2 still pending
    assert (writer.pending_step, writer.committed_step) == (2, 1)
    writer.save(3, {"model.pt": {"w": torch.ones(3)}})  # finishes step 2 first
    assert latest_checkpoint(tmp_path).name == "step_0000002"
    writer.wait()
    assert latest_checkpoint(tmp_path).name == "step_0000003"
    assert (writer.pending_step, writer.committed_step) == (None, 3)


def test_what_stopping_loses_counts_a_save_still_written_as_lost(tmp_path):
    """The trainer's account of what stopping now loses (a second Ctrl-C, the device watchdog): a
    background save is not a checkpoint until it is committed."""
    from types import SimpleNamespace

    from megazero.trainer import Trainer
    writer = CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone, async_save=True)
    run = SimpleNamespace(writer=writer, resumed_step=0, state=SimpleNamespace(step=0))
    assert Trainer._unsaved(run) == "nothing: no step had finished"  # not "step 0 is saved": there is none
    run.state.step = 1
    assert Trainer._unsaved(run) == "step 1 (no checkpoint yet)"
    run.state.step = 12
    assert Trainer._unsaved(run) == "steps 1-12 (no checkpoint yet)"
    writer.save(10, {"model.pt": {"w": torch.ones(3)}})
    assert Trainer._unsaved(run) == "steps 1-12 (no checkpoint yet; step 10's is still being written and would be lost)"
    writer.wait()
    assert Trainer._unsaved(run) == "steps 11-12 (the last checkpoint is step 10)"
    run.state.step = 10
    assert Trainer._unsaved(run) == "nothing: step 10 is saved"
    resumed = SimpleNamespace(writer=CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone),
                              resumed_step=10, state=SimpleNamespace(step=10))
    assert Trainer._unsaved(resumed) == "nothing: step 10 is saved"
    resumed.writer.save(20, {"model.pt": {"w": torch.ones(3)}})
    resumed.state.step = 25
    assert Trainer._unsaved(resumed) == "steps 21-25 (the last checkpoint is step 20)"  # not the one resumed from


def test_async_save_that_fails_is_not_committed(tmp_path):
    """A save that fails is no checkpoint: what stopping loses (``Trainer._unsaved``) still counts from
    the one before it."""
    writer = CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone, async_save=True)
    writer.save(1, {"model.pt": {"w": torch.ones(3)}})
    writer.wait()
    writer.save(2, {"model.pt": {"w": object()}})  # refused by its writing thread
    with pytest.raises(CheckpointError, match="could not write"):
        writer.wait()
    assert (writer.pending_step, writer.committed_step) == (None, 1)


def test_a_view_of_a_large_buffer_saves_only_the_view(tmp_path):
    flat = torch.zeros(1_000_000)
    CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone).save(1, {"shard.pt": {"w": flat[10:20]}})
    assert read_manifest(tmp_path / "step_0000001")["files"]["shard.pt"]["bytes"] < 10_000
    assert torch.equal(load_file(tmp_path / "step_0000001", "shard.pt")["w"], flat[10:20])


def test_file_names_must_be_unique_across_ranks(tmp_path):
    errors = save_on_threads(tmp_path, 2, 1, False, names=["same.pt", "same.pt"])
    assert "written by both rank 0 and rank 1" in str(errors[0])
    assert "could not complete" in str(errors[1])
    assert latest_checkpoint(tmp_path) is None


@pytest.mark.parametrize("name", ["/abs.pt", "../up.pt", "COMPLETE", "manifest.rank00000.json", "", "COMPLETE.tmp",
                                  "./a.pt", "sub//a.pt", "sub/", "sub/./a.pt", "."])
def test_bad_file_names_are_rejected(tmp_path, name):
    """A name must be the one spelling of a file of its own: ``./a.pt`` beside another rank's ``a.pt``
    is the same file, which the commit's check of unique names would not see, and ``COMPLETE.tmp``
    is the marker's own temporary."""
    with pytest.raises(ValueError, match="checkpoint file name"):
        CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone).save(1, {name: 1})


def _gloo_round_trip(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed as dist

    results = {}
    for step, async_save in ((1, False), (2, True)):
        writer = CheckpointWriter(root, rank=rank, world_size=world_size, barrier=dist.barrier,
                                  keep_last=2, async_save=async_save)
        writer.save(step, {f"rank{rank}.pt": shard(rank, step)}, meta={"step": step})
        writer.wait()
        ckpt = latest_checkpoint(root)
        other = (rank + 1) % world_size  # read another rank's shard, as resharding does
        loaded = load_file(ckpt, f"rank{other}.pt")
        results[step] = (ckpt.name, torch.equal(loaded["weight"], shard(other, step)["weight"]))
    return results


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    return run_world(2, _gloo_round_trip, str(tmp_path_factory.mktemp("gloo_ckpt")), timeout=120)


@pytest.mark.parametrize("step", [1, 2])
def test_gloo_ranks_save_and_read_each_others_shards(gloo_results, step):
    for rank_result in gloo_results:
        assert rank_result[step] == (f"step_{step:07d}", True)


# --- atomicity ----------------------------------------------------------------------------------

KILLED_SAVE = textwrap.dedent("""
    import sys, time, torch
    from megazero.checkpoint import CheckpointWriter
    from megazero.checkpoint.format import HashingWriter

    root, where = sys.argv[1], sys.argv[2]
    barriers = []

    write = HashingWriter.write

    def stalling_write(self, data):  # stop for good half-way through the big tensor's bytes
        if where == "mid_file" and len(data) >= 1 << 20:
            write(self, data[: len(data) // 2])
            self.f.flush()
            print("STALLED", flush=True)
            time.sleep(120)
        return write(self, data)

    def barrier():
        barriers.append(1)
        if where == "before_complete" and len(barriers) == 5:  # step 2's files written, not committed
            print("STALLED", flush=True)
            time.sleep(120)

    writer = CheckpointWriter(root, rank=0, world_size=1, barrier=barrier)
    writer.save(1, {"model.pt": {"w": torch.arange(4.0)}})
    HashingWriter.write = stalling_write
    writer.save(2, {"model.pt": {"w": torch.arange(4.0) * 2, "pad": torch.zeros(1 << 18)}})  # 1 MiB
""")


@pytest.mark.parametrize("where", ["mid_file", "before_complete"])
def test_kill_9_during_a_save_leaves_the_previous_checkpoint_latest(tmp_path, where):
    root = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(root), where], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "STALLED", proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert (root / "step_0000002.tmp").is_dir()  # the partial save is there...
    size = (root / "step_0000002.tmp" / "model.pt").stat().st_size
    assert (1 << 18 < size < 1 << 20) if where == "mid_file" else size > 1 << 20
    ckpt = latest_checkpoint(root)  # ...and ignored
    assert ckpt == root / "step_0000001"
    assert torch.equal(load_file(ckpt, "model.pt")["w"], torch.arange(4.0))
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        resolve_checkpoint(root / "step_0000002.tmp")
    # the restarted run saves the same step again over the debris, none of which it keeps: a file
    # of the died save that the new one does not write (another layout's) is gone with the rest
    (root / "step_0000002.tmp" / "optim_rank3.pt").write_bytes(b"stale")
    CheckpointWriter(root, rank=0, world_size=1, barrier=alone).save(2, {"model.pt": {"w": torch.ones(2)}})
    assert latest_checkpoint(root) == root / "step_0000002"
    assert not (root / "step_0000002.tmp").exists()
    assert sorted(p.name for p in (root / "step_0000002").iterdir() if p.suffix == ".pt") == ["model.pt"]


def test_a_newer_directory_without_complete_marker_stops_a_resume(tmp_path):
    """A save writes COMPLETE before its rename and retention deletes only older checkpoints, so a
    newer step directory without one was made or edited by hand. Resuming from the older complete
    one would later save over it (the step directory is replaced): it is named instead, even the very
    next step. Older ones (a deletion that stopped part-way) are skipped. (Planted: only directories
    more than one step newer counted.)"""
    CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone).save(1, {"m.pt": {"w": torch.ones(1)}})
    (tmp_path / "step_0000000").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_0000001"
    (tmp_path / "step_0000002").mkdir()  # renamed by hand, or a foreign directory: no COMPLETE
    (tmp_path / "step_0000002" / "m.pt").write_bytes(b"x")
    (tmp_path / "latest").write_text("step_0000002\n")
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1]
    for find in (latest_checkpoint, resolve_checkpoint):
        with pytest.raises(CheckpointError, match="step_0000002: a checkpoint directory without its COMPLETE record"):
            find(tmp_path)
    with pytest.raises(CheckpointError, match="step_0000002: not a complete checkpoint"):
        resolve_checkpoint(tmp_path / "step_0000002")


def test_a_checkpoint_under_another_steps_name_is_refused(tmp_path):
    """Checkpoints are found, ordered and pruned by their folder's name: a copy of step 4's under step
    6's name was resumed as step 4 without a word, chosen over a real step 5, and its step's name
    left for retention to count. Its record is checked against its name now. A save cut between its
    COMPLETE record and its rename is said as such, not as one without a record. (Planted: no check
    of the name; the .tmp's record not looked for.)"""
    writer = CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone)
    writer.save(4, {"m.pt": {"w": torch.ones(1)}})
    writer.save(5, {"m.pt": {"w": torch.ones(1)}})
    shutil.copytree(tmp_path / "step_0000004", tmp_path / "step_0000006")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_0000006"
    with pytest.raises(CheckpointError, match=r"step_0000006: its COMPLETE records step 4, not the step its name "
                                              r"says \(a checkpoint copied under another name\?\); name it "
                                              r"step_0000004, or move it out of the way"):
        read_manifest(resolve_checkpoint(tmp_path))
    assert read_manifest(tmp_path / "step_0000005")["step"] == 5
    shutil.copytree(tmp_path / "step_0000005", tmp_path / "step_0000007.tmp")  # written whole, not renamed
    with pytest.raises(CheckpointError, match=r"step_0000007.tmp: a save stopped after writing its COMPLETE record, "
                                              r"before renaming the directory into place; rename it step_0000007"):
        resolve_checkpoint(tmp_path / "step_0000007.tmp")


def test_a_damaged_only_checkpoint_is_one_line_with_the_callers_way_forward(tmp_path, capsys):
    """With no complete checkpoint left, a resume can start afresh but an explicit load (convert's
    SRC, generate's checkpoint) cannot; and the pointer naming the damaged directory adds no warning
    line before the error."""
    (tmp_path / "step_0000009").mkdir()
    (tmp_path / "latest").write_text("step_0000009\n")
    with pytest.raises(CheckpointError, match=r"restore it, or move it out of the way to train from step 0$"):
        latest_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"restore it, or give another checkpoint as the SRC argument$"):
        resolve_checkpoint(tmp_path, source="the SRC argument")
    with pytest.raises(CheckpointError, match=r"^checkpoint.save_dir: .* to train from step 0$"):
        start_checkpoint(None, tmp_path)
    with pytest.raises(CheckpointError, match=r"^checkpoint.save_dir: .* to start from checkpoint.load other/run$"):
        start_checkpoint("other/run", tmp_path)  # with a load, moving it away starts there, not at step 0
    assert capsys.readouterr().err == ""


def test_empty_or_missing_root_has_no_checkpoint(tmp_path):
    assert latest_checkpoint(tmp_path / "nowhere") is None
    assert latest_checkpoint(tmp_path) is None


def test_an_explicit_load_path_must_hold_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="nowhere: checkpoint path does not exist"):
        resolve_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        resolve_checkpoint(tmp_path)


# --- damage -------------------------------------------------------------------------------------

@pytest.fixture
def saved(tmp_path) -> Path:
    CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone).save(
        7, {"model.pt": shard(0, 7), "optim.pt": {"m": torch.ones(100)}})
    return tmp_path / "step_0000007"


def test_a_checkpoint_is_found_through_a_link_or_dot_and_a_renamed_one_is_named(saved, monkeypatch):
    """A checkpoint given as ".", from inside it, or through a link named "best", was said to hold no
    checkpoint, and so was a copy under another name. The first two now load; the copy is named as
    what it is. (Planted: the name checked as typed.)"""
    (saved.parent / "best").symlink_to(saved.name)
    assert resolve_checkpoint(saved.parent / "best") == saved
    monkeypatch.chdir(saved)
    assert resolve_checkpoint(".") == saved
    shutil.copytree(saved, saved.parent / "mine")
    with pytest.raises(CheckpointError, match=r"mine: holds a checkpoint under a name other than step_NNNNNNN"):
        resolve_checkpoint(saved.parent / "mine")


def test_flipped_byte_fails_the_checksum_naming_the_file(saved):
    path = saved / "model.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{path}: sha256 .* does not match"):
        load_file(saved, "model.pt")
    with pytest.raises(CheckpointError, match="model.pt: sha256"):
        verify_checkpoint(saved)
    load_file(saved, "optim.pt")  # an undamaged file of the same checkpoint still loads


def test_a_byte_flipped_past_the_first_read_chunk_fails_the_checksum(tmp_path):
    """The sha256 streams a file in chunks of a MiB: every chunk counts, the intact file's and the
    damaged one's past its first chunk."""
    CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone).save(1, {"big.pt": {"w": torch.zeros(600_000)}})
    path = tmp_path / "step_0000001" / "big.pt"
    assert torch.equal(load_file(path.parent, "big.pt")["w"], torch.zeros(600_000))  # whole, it is checked whole
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{path}: sha256 .* does not match"):
        load_file(tmp_path / "step_0000001", "big.pt")


def test_truncation_is_caught_by_size_naming_the_file(saved):
    path = saved / "optim.pt"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"{path}: 100 bytes but the checkpoint manifest records"):
        load_file(saved, "optim.pt")
    with pytest.raises(CheckpointError, match="optim.pt: 100 bytes"):  # every file is checked, not the first only
        verify_checkpoint(saved)


def test_missing_file_is_named(saved):
    (saved / "model.pt").unlink()
    with pytest.raises(CheckpointError, match=f"{saved / 'model.pt'}: checkpoint file is missing"):
        verify_checkpoint(saved)


def test_unknown_file_name_lists_what_is_there(saved):
    with pytest.raises(CheckpointError, match="has no file 'rank9.pt' .it holds model.pt, optim.pt"):
        load_file(saved, "rank9.pt")


def test_damaged_complete_marker_is_named(saved):
    (saved / "COMPLETE").write_text("{not json")
    with pytest.raises(CheckpointError, match="COMPLETE: the completion marker is not valid JSON"):
        read_manifest(saved)
    (saved / "COMPLETE").write_text("[" * 100_000 + "]" * 100_000)  # was a RecursionError traceback
    with pytest.raises(CheckpointError, match="COMPLETE: the completion marker is nested too deeply"):
        read_manifest(saved)


# --- keep last ----------------------------------------------------------------------------------

def test_keep_last_deletes_only_older_complete_checkpoints(tmp_path):
    writer = CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone, keep_last=2)
    (tmp_path / "step_0000099.tmp").mkdir(parents=True)  # debris of some earlier crash
    for step in range(1, 6):
        writer.save(step, {"m.pt": {"w": torch.full((2,), float(step))}})
        assert [s for s, _ in list_checkpoints(tmp_path)] == list(range(max(1, step - 1), step + 1))
    assert latest_checkpoint(tmp_path).name == "step_0000005"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_0000004", "step_0000005"]


def test_resaving_a_step_replaces_it(tmp_path):
    writer = CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone, keep_last=1)
    writer.save(3, {"m.pt": {"w": torch.zeros(2)}})
    writer.save(3, {"m.pt": {"w": torch.ones(2)}})
    assert torch.equal(load_file(tmp_path / "step_0000003", "m.pt")["w"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_0000003"]


# --- preemption ---------------------------------------------------------------------------------


def test_range_reads_equal_the_library_and_refuse_a_bad_header(tmp_path):
    """Checkpoint tensors are read by element range with plain reads (no memory map, which a host
    refuses for files larger than its memory): every range equals what safetensors itself reads,
    for every dtype, and a header that does not fit the file is a format error, not a crash."""
    from safetensors.torch import load_file as library_load

    from megazero.checkpoint.serialization import DTYPES, FileFormatError, RangeFile, write

    gen = torch.Generator().manual_seed(0)
    tensors = {str(dtype): (torch.randn(37, 5, generator=gen) * 50).to(dtype) for dtype in DTYPES}
    path = tmp_path / "ranges.safetensors"
    with open(path, "wb") as f:
        write(tensors, f)
    library = library_load(path)
    with RangeFile(path) as f:
        for name in library:
            assert torch.equal(f.read(name), library[name]), name
            assert torch.equal(f.read(name, 11, 70), library[name].reshape(-1)[11:81]), name
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:len(data) // 2])
    (tmp_path / "header.safetensors").write_bytes((len(data) * 2).to_bytes(8, "little") + data[8:])
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    header[next(k for k in header if k != "__metadata__")]["shape"] = [37, 6]  # more elements than its bytes
    text = json.dumps(header).encode()
    (tmp_path / "shape.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length:])
    for bad in ("cut.safetensors", "header.safetensors", "shape.safetensors"):
        with pytest.raises(FileFormatError):
            RangeFile(tmp_path / bad)
    shutil.copy(path, tmp_path / "shrinks.safetensors")
    with RangeFile(tmp_path / "shrinks.safetensors") as f:  # cut after the header was read (a copy still running)
        os.truncate(tmp_path / "shrinks.safetensors", len(data) - 8)
        with pytest.raises(FileFormatError, match="is cut short"):
            [f.read(name) for name in f.keys()]


def test_a_retention_delete_that_fails_leaves_no_step_directory_behind(tmp_path, monkeypatch):
    """Retention renames a checkpoint before deleting it: a deletion that fails part-way (a busy file
    on NFS) leaves a leftover the next save clears, not a step_N without COMPLETE that would stop
    the next launch."""
    import shutil as real_shutil

    from megazero.checkpoint import writer as writer_module

    writer = CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone, keep_last=1)
    writer.save(1, {"m.pt": {"w": torch.ones(1)}})

    def half_delete(path, ignore_errors=False):
        (Path(path) / "COMPLETE").unlink(missing_ok=True)
        if not ignore_errors:
            raise OSError(16, "Device or resource busy")

    monkeypatch.setattr(writer_module.shutil, "rmtree", half_delete)
    writer.save(2, {"m.pt": {"w": torch.ones(1)}})  # the failed clean-up is a warning
    monkeypatch.setattr(writer_module.shutil, "rmtree", real_shutil.rmtree)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_0000002"
    assert not (tmp_path / "step_0000001").exists()
