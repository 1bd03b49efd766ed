"""Saves that fail: a full disk, a read-only or forbidden directory, on one rank or all. Every rank gets
one CheckpointError naming the directory and the rank (and, where it happened, the reason in words),
the partial directory is removed and the previous checkpoint stays the latest. ``probe_writable``
finds the same problems before the first step. A power loss is a failure too: every file, and each
rename, is made durable before ``latest`` names the new checkpoint."""

from __future__ import annotations

import errno
import shutil
import subprocess
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from megazero.checkpoint import CheckpointError, CheckpointWriter, latest_checkpoint, list_checkpoints, load_file
from megazero.checkpoint import format as format_module
from megazero.checkpoint import probe_writable
from megazero.checkpoint import writer as writer_module
from megazero.checkpoint.format import HashingWriter
from megazero.checkpoint.writer import RETIRED
from tests.test_checkpoint_io import save_rank_files

BIG = 1 << 18  # float32 elements: a 1 MiB tensor
NO_SPACE = "no space left on device: free space, or lower checkpoint.keep_last where older checkpoints take it"
DISCARDED = "the partial checkpoint was removed and the previous one, if any, is still the latest"


def alone() -> None:
    """The barrier of a one-rank world."""


def small(rank: int, value: float) -> dict:
    return {f"rank{rank}.pt": {"w": torch.full((4,), value)}}


def failing_write(error: int, min_bytes: int):
    """A ``HashingWriter.write`` for a disk that refuses any write of ``min_bytes`` or more."""
    real = HashingWriter.write

    def write(self, data):
        if len(data) >= min_bytes:
            raise OSError(error, "injected failure")
        return real(self, data)
    return write


def assert_previous_is_latest(root: Path, step: int = 1) -> None:
    assert [s for s, _ in list_checkpoints(root)] == [step]
    assert latest_checkpoint(root) == root / f"step_{step:07d}"
    assert (root / "latest").read_text().strip() == f"step_{step:07d}"
    assert not list(root.glob("step_*.tmp")) and not list(root.glob("*.tmp"))


# --- a full disk ----------------------------------------------------------------------------------

@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_on_one_rank_fails_every_rank_and_removes_the_partial_save(tmp_path, monkeypatch, async_save):
    assert save_rank_files(tmp_path, 1, [small(0, 1.0), small(1, 1.0)]) == [None, None]
    monkeypatch.setattr(HashingWriter, "write", failing_write(errno.ENOSPC, 1 << 20))
    errors = save_rank_files(tmp_path, 2, [small(0, 2.0), {"rank1.pt": {"w": torch.zeros(BIG)}}], async_save)
    tmp = tmp_path / "step_0000002.tmp"
    assert all(isinstance(e, CheckpointError) and "\n" not in str(e) for e in errors), errors
    assert str(errors[1]) == f"{tmp}: rank 1 could not write its checkpoint files: {NO_SPACE}; {DISCARDED}"
    assert str(errors[0]).startswith(f"{tmp}: rank 1 did not finish writing its checkpoint files")
    assert_previous_is_latest(tmp_path)
    assert torch.equal(load_file(latest_checkpoint(tmp_path), "rank1.pt")["w"], torch.ones(4))
    monkeypatch.undo()  # space freed: the next save goes through
    assert save_rank_files(tmp_path, 2, [small(0, 2.0), small(1, 2.0)]) == [None, None]
    assert latest_checkpoint(tmp_path).name == "step_0000002"


@pytest.mark.parametrize("failing", [0, 1, 2])
def test_ranks_that_gather_all_raise_the_failing_ranks_words_once(tmp_path, monkeypatch, failing):
    """Given a gather (the trainer's ranks have one), every rank raises the failing rank's own line,
    marked agreed, so a launch prints the cause once instead of one line a rank."""
    monkeypatch.setattr(HashingWriter, "write", failing_write(errno.ENOSPC, 1 << 20))
    files = [small(r, 1.0) for r in range(3)]
    files[failing] = {f"rank{failing}.pt": {"w": torch.zeros(BIG)}}
    errors = save_rank_files(tmp_path, 1, files, gathers=True)
    expected = f"{tmp_path / 'step_0000001.tmp'}: rank {failing} could not write its checkpoint files: {NO_SPACE}; {DISCARDED}"
    assert [str(e) for e in errors] == [expected] * 3
    assert all(isinstance(e, CheckpointError) and e.agreed for e in errors)
    assert not list(tmp_path.glob("step_*"))


@pytest.mark.parametrize("error, words", [
    (errno.ENOSPC, NO_SPACE),
    (errno.EDQUOT, "disk quota exceeded: free space in the quota, or lower checkpoint.keep_last where older "
                   "checkpoints take it"),
    (errno.EACCES, "permission denied: make the directory writable or set checkpoint.save_dir to another one"),
    (errno.EROFS, "read-only file system: set checkpoint.save_dir to a writable directory"),
    (errno.ENAMETOOLONG, "injected failure"),  # no words of our own: the system's
])
def test_the_reason_is_given_in_words(tmp_path, monkeypatch, error, words):
    writer = CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone)
    writer.save(1, small(0, 1.0))
    monkeypatch.setattr(HashingWriter, "write", failing_write(error, 1))
    with pytest.raises(CheckpointError) as failure:
        writer.save(2, small(0, 2.0))
    assert str(failure.value) == (f"{tmp_path / 'step_0000002.tmp'}: rank 0 could not write its checkpoint files: "
                                  f"{words}; {DISCARDED}")
    assert_previous_is_latest(tmp_path)


def test_rank0_unable_to_create_the_directory_leaves_no_rank_waiting(tmp_path, monkeypatch):
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self.name.endswith(".tmp"):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    errors = save_rank_files(tmp_path, 1, [small(0, 1.0), small(1, 1.0)])
    tmp = tmp_path / "step_0000001.tmp"
    assert str(errors[0]).startswith(f"{tmp}: rank 0 could not create this checkpoint directory: permission denied")
    assert str(errors[1]).startswith(f"{tmp}: rank 0 could not complete this checkpoint")
    assert latest_checkpoint(tmp_path) is None


@pytest.mark.parametrize("resave", [False, True])
def test_a_failed_commit_rolls_back(tmp_path, monkeypatch, resave):
    """No space for COMPLETE, or for the new ``latest``: the new checkpoint is gone, the old one latest
    (re-saving a step keeps the first copy)."""
    writer = CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone)
    writer.save(1, small(0, 1.0))
    real = writer_module.write_text_atomic
    for marker in ("COMPLETE", "latest"):
        def write_text_atomic(path, text, marker=marker):
            if path.name == marker:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(path, text)

        monkeypatch.setattr(writer_module, "write_text_atomic", write_text_atomic)
        with pytest.raises(CheckpointError, match=f"step_000000{1 if resave else 2}.tmp: rank 0 could not complete "
                                                  f"this checkpoint: {NO_SPACE}; the partial"):
            writer.save(1 if resave else 2, small(0, 2.0))
        assert_previous_is_latest(tmp_path)
        assert torch.equal(load_file(tmp_path / "step_0000001", "rank0.pt")["w"], torch.ones(4))


def test_a_failed_small_write_keeps_the_old_content_and_leaves_no_temporary(tmp_path, monkeypatch):
    pointer = tmp_path / "latest"
    format_module.write_text_atomic(pointer, "step_0000001\n")

    def fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(format_module.os, "fsync", fsync)
    with pytest.raises(OSError):
        format_module.write_text_atomic(pointer, "step_0000002\n")
    assert pointer.read_text() == "step_0000001\n" and sorted(tmp_path.iterdir()) == [pointer]


@pytest.fixture
def tiny_filesystem(tmp_path):
    """A real 256 KiB file system (a tmpfs: mounting one needs root; skipped otherwise)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_real_full_file_system(tiny_filesystem):
    root = tiny_filesystem / "ckpt"
    writer = CheckpointWriter(root, rank=0, world_size=1, barrier=alone)
    writer.save(1, small(0, 1.0))
    free = shutil.disk_usage(tiny_filesystem).free
    with pytest.raises(CheckpointError, match=f"step_0000002.tmp: rank 0 could not write its checkpoint files: "
                                              f"{NO_SPACE}; the partial"):
        writer.save(2, {"rank0.pt": {"w": torch.zeros(BIG)}})
    assert_previous_is_latest(root)
    assert shutil.disk_usage(tiny_filesystem).free == free  # the partial file is gone
    with pytest.raises(CheckpointError, match=r"iB free, a checkpoint needs about 1\.0 GiB"):
        probe_writable(root, 1 << 30)


# --- probing before the first step ----------------------------------------------------------------

def test_probe_creates_the_directory_and_leaves_nothing_behind(tmp_path):
    probe_writable(tmp_path / "a" / "b", 1)
    assert list((tmp_path / "a" / "b").iterdir()) == []


def test_probe_refuses_a_folder_named_latest(tmp_path):
    """Every save renames its pointer onto ``latest``; a folder of that name passed the probe, and the
    run trained to its first save, which failed ("Is a directory") naming neither the folder nor the
    fix. A link to a folder is replaced like a file. (Planted: the probe without the check.)"""
    (tmp_path / "ckpt" / "latest").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"ckpt/latest: is a folder, where every save writes its pointer to the "
                                              r"newest checkpoint \(a file\); move it out of "):
        probe_writable(tmp_path / "ckpt", 1)
    (tmp_path / "ckpt" / "latest").rmdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "ckpt" / "latest").symlink_to(tmp_path / "elsewhere")
    probe_writable(tmp_path / "ckpt", 1)
    writer = CheckpointWriter(tmp_path / "ckpt", rank=0, world_size=1, barrier=alone)
    writer.save(1, small(0, 1.0))
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_0000001"


def test_probe_of_a_path_under_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="file/ckpt: checkpoints cannot be written here: a part of the path is a "
                                              "file, not a directory"):
        probe_writable(tmp_path / "file" / "ckpt", 1)
    with pytest.raises(CheckpointError, match="file: checkpoints cannot be written here: the path exists and is not "
                                              "a directory"):
        probe_writable(tmp_path / "file", 1)


@pytest.mark.parametrize("error, words", [
    (errno.EROFS, "read-only file system: set checkpoint.save_dir to a writable directory"),
    (errno.EACCES, "permission denied: make the directory writable or set checkpoint.save_dir to another one"),
    (errno.ENOSPC, NO_SPACE),
])
def test_probe_of_a_directory_that_refuses_writes(tmp_path, monkeypatch, error, words):
    def mkstemp(**kwargs):  # tests run as root, for whom chmod forbids nothing
        raise OSError(error, "injected")

    monkeypatch.setattr(format_module.tempfile, "mkstemp", mkstemp)
    with pytest.raises(CheckpointError) as failure:
        probe_writable(tmp_path, 1)
    assert str(failure.value) == f"{tmp_path}: checkpoints cannot be written here: {words}"


def test_probe_of_a_directory_without_enough_space(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(format_module.shutil, "disk_usage", lambda path: usage(8 << 30, 6.5 * 2**30, 1.5 * 2**30))
    probe_writable(tmp_path, 1.5 * 2**30)  # just enough
    with pytest.raises(CheckpointError) as failure:
        probe_writable(tmp_path, 2 << 30)  # a third more than there is
    assert str(failure.value) == (f"{tmp_path}: 1.5 GiB free, a checkpoint needs about 2.0 GiB; free space or set "
                                  "checkpoint.save_dir to a larger file system")


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names a descriptor's file through /proc")
def test_a_save_is_durable_before_it_is_named(tmp_path, monkeypatch):
    """A power loss must not leave a ``latest`` (or a ``step_N`` with ``COMPLETE``) whose data never
    reached the disk, while older checkpoints are pruned. So, in order: every file is fsynced
    before the directory holding it is renamed into place, the temporary directory's entries and
    then the checkpoint root's rename are fsynced before ``latest`` names the new step, and
    ``latest`` itself is fsynced before its rename. Recorded from the system calls (Linux names an
    open descriptor's path under /proc/self/fd)."""
    import os

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    writer = CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone)
    writer.save(1, {**small(0, 1.0), "sub/extra.pt": {"v": torch.zeros(2)}})
    final, tmp = tmp_path / "step_0000001", str(tmp_path / "step_0000001.tmp")

    def at(event):
        assert event in events, f"{event} never happened: {events}"
        return events.index(event)

    commit = at(("replace", tmp, str(final)))
    written = []
    for path in sorted(final.rglob("*")):
        if path.is_file():  # small files are written as NAME.tmp and renamed
            name = f"{tmp}/{path.relative_to(final)}"
            written.append(at(("fsync", name)) if ("fsync", name) in events else at(("fsync", name + ".tmp")))
    assert len(written) == 4 and max(written) < commit, "a file was fsynced only after the commit"
    # each folder after the last file written into it: tmp's files and the subfolder's entry, then sub's file
    for folder, last in ((tmp, max(written)), (f"{tmp}/sub", at(("fsync", f"{tmp}/sub/extra.pt")))):
        entries = [i for i, e in enumerate(events) if e == ("fsync", folder)]
        assert any(last < i < commit for i in entries), f"{folder}'s entries were not made durable"
    pointer = at(("replace", str(tmp_path / "latest.tmp"), str(tmp_path / "latest")))
    assert commit < at(("fsync", str(tmp_path))) < pointer, "the commit's rename was not made durable first"
    assert at(("fsync", str(tmp_path / "latest.tmp"))) < pointer


def test_a_directory_cut_before_its_rename_or_while_retired_is_never_a_checkpoint(tmp_path):
    """``step_N.tmp`` holds ``COMPLETE`` between the commit record and its rename, and a retired
    ``step_N.retired-by-megazero`` still holds it until it is deleted: neither may be listed or resumed
    from."""
    writer = CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone)
    writer.save(1, small(0, 1.0))
    shutil.copytree(tmp_path / "step_0000001", tmp_path / "step_0000002.tmp")
    shutil.copytree(tmp_path / "step_0000001", tmp_path / f"step_0000003{RETIRED}")
    assert (tmp_path / "step_0000002.tmp" / "COMPLETE").is_file()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_0000001"
    writer.save(2, small(0, 2.0))  # the next save clears both and commits its own step 2
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 2]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_0000002"
    assert torch.equal(load_file(tmp_path / "step_0000002", "rank0.pt")["w"], torch.full((4,), 2.0))
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(f"*{RETIRED}"))


def test_a_checkpoint_moved_aside_by_hand_is_kept(tmp_path):
    """A person rolling back renamed step_4 to step_4.old, to keep it: the next save deleted it with the
    writer's own leftovers, and so did a save of step 4 again. (Planted: the writer's retired name .old.)"""
    writer = CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone, keep_last=1)
    writer.save(4, small(0, 4.0))
    (tmp_path / "step_0000004").rename(tmp_path / "step_0000004.old")
    for step in (3, 4):
        writer.save(step, small(0, float(step)))
    assert torch.equal(load_file(tmp_path / "step_0000004.old", "rank0.pt")["w"], torch.full((4,), 4.0))
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4] and not list(tmp_path.glob(f"*{RETIRED}"))


def test_a_checkpoint_counts_as_committed_once_the_pointer_names_it(tmp_path, monkeypatch):
    """What a second Ctrl-C says it loses reads ``committed_step``: it was set only as the save's wait
    returned, after the older checkpoints were pruned, so a stop in between claimed a step lost that
    was complete and named by ``latest``. It is set before the pruning starts."""
    seen = []
    writer = CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=alone, keep_last=1)
    monkeypatch.setattr(writer, "_prune", lambda step: seen.append((step, writer.committed_step)))
    writer.save(5, {"m.pt": {"w": torch.ones(1)}})
    writer.wait()
    assert seen == [(5, 5)]
