"""Indexed dataset writes that leave no half-made shard: the temporary files a write goes through, put
in place only whole and in the right order, removed when a writer fails, is interrupted or (by the
next writer of the prefix) was killed outright; and writers on one prefix at once, which never take
each other's files."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import data_pipeline.file_locks as file_locks
import data_pipeline.indexed as indexed
from data_pipeline.indexed import IndexedDataset, IndexedDatasetWriter
from tests.test_data_indexed import write


def test_interrupted_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), IndexedDatasetWriter(str(tmp_path / "a"), np.uint16) as w:
        w.add_document([1, 2, 3])
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def test_an_interrupt_as_the_temporary_file_opens_leaves_nothing(tmp_path, monkeypatch):
    """SIGTERM (raised as Ctrl-C is) or Ctrl-C handled as open() returns comes after the temporary .bin
    exists but before the writer holds it; the writer was never made, so nothing aborted it, and the
    file stayed (a run stopped by SIGTERM left it now and then under load)."""
    real_open = open

    def interrupted(path, *args, **kwargs):
        real_open(path, *args, **kwargs).close()
        raise KeyboardInterrupt

    monkeypatch.setattr(indexed, "open", interrupted, raising=False)
    with pytest.raises(KeyboardInterrupt):
        IndexedDatasetWriter(str(tmp_path / "new" / "a"), np.uint16)
    assert list(tmp_path.iterdir()) == []  # neither the file nor the folder made for it


def test_unfinished_write_is_not_visible(tmp_path):
    w = IndexedDatasetWriter(str(tmp_path / "a"), np.uint16)
    w.add_document([1, 2, 3])
    assert not os.path.exists(tmp_path / "a.bin") and not os.path.exists(tmp_path / "a.idx")
    w.finish()
    assert IndexedDataset(str(tmp_path / "a"))[0].tolist() == [1, 2, 3]


KILLED_WRITER = """
import os, signal, sys
import numpy as np
from data_pipeline import indexed

prefix, where, replace = sys.argv[1:]
writer = indexed.IndexedDatasetWriter(prefix, np.uint16, replace=replace == "replace")
writer.add_document([1, 2])
writer.seal()
if where == "between renames":  # the writer takes each temporary's identity just before putting it in place
    identity = indexed._identity
    indexed._identity = lambda path: os.kill(os.getpid(), signal.SIGKILL) if ".idx.tmp-" in path else identity(path)
    writer.publish()
os.kill(os.getpid(), signal.SIGKILL)
"""


def _kill_a_writer(prefix: str, where: str, replace: bool = True) -> None:
    """Run a writer of ``prefix`` in a process of its own, killed outright (SIGKILL) ``where``: "after
    seal", or "between renames" (its .bin put in place, its .idx not)."""
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITER, prefix, where, "replace" if replace else "keep"],
                            capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr


def _names(folder) -> list[str]:
    """The files in ``folder``, each temporary's tag cut off."""
    return sorted(p.name.split("-")[0] for p in folder.iterdir())


@pytest.mark.timeout(60)
def test_a_killed_writers_temporaries_are_swept_and_a_live_ones_kept(tmp_path):
    """A writer killed outright (SIGKILL, the OOM killer) runs no cleanup: its temporaries stayed for
    ever, a large shard's .bin holding its size on the disk (planted: no sweep). The next writer of
    the prefix removes those whose lock no process holds, its sealed .idx with its .bin (planted: the
    .idx temporary under a tag of its own, which the sweep did not find), and leaves a live writer's,
    sealed or not, without waiting for its lock (planted: the sweep waiting, which hung)."""
    prefix = str(tmp_path / "a")
    _kill_a_writer(prefix, "after seal")
    assert _names(tmp_path) == ["a.bin.tmp", "a.idx.tmp"]
    sealed = IndexedDatasetWriter(prefix, np.uint16)
    sealed.add_document([1, 2])
    sealed.seal()
    assert _names(tmp_path) == ["a.bin.tmp", "a.idx.tmp"]
    writing = IndexedDatasetWriter(prefix, np.uint16)
    assert _names(tmp_path) == ["a.bin.tmp", "a.bin.tmp", "a.idx.tmp"]
    sealed.finish()
    writing.abort()
    assert _names(tmp_path) == ["a.bin", "a.idx"]


class Killed(BaseException):
    """The process dying where it is raised: no cleanup of the writer's runs."""


@pytest.mark.parametrize("replace", [True, False], ids=["replacing", "not replacing"])
def test_an_idx_left_by_a_writer_killed_between_its_renames_is_swept_and_a_live_ones_kept(tmp_path, monkeypatch,
                                                                                          replace):
    """Killed once its .bin was put in place, a writer left its .idx temporary with no .bin temporary
    beside it, which the sweep (finding temporaries by the .bin's) never removed (planted: the sweep
    of .bin temporaries alone). A live writer stopped at the same point keeps its own: it holds the
    .idx temporary's lock from before the .bin's rename (planted: no lock on it, so any sweep took it),
    and then publishes its shard whole."""
    prefix = str(tmp_path / "a")
    _kill_a_writer(prefix, "between renames", replace)
    assert _names(tmp_path) == ["a.bin", "a.idx.tmp"]
    live = IndexedDatasetWriter(prefix, np.uint16)
    assert _names(tmp_path) == ["a.bin", "a.bin.tmp"]
    live.add_document([3, 4, 5])
    live.seal()
    identity = indexed._identity

    def stopped_at_the_idx(path):
        if ".idx.tmp-" in path:
            raise Killed
        return identity(path)

    monkeypatch.setattr(indexed, "_identity", stopped_at_the_idx)
    with pytest.raises(Killed):
        live.publish()
    monkeypatch.undo()  # the stop is for that writer's renames only, not for the next writer's sweep
    assert _names(tmp_path) == ["a.bin", "a.idx.tmp"]
    later = IndexedDatasetWriter(prefix, np.uint16)
    assert _names(tmp_path) == ["a.bin", "a.bin.tmp", "a.idx.tmp"]
    live.publish()
    later.abort()
    assert _names(tmp_path) == ["a.bin", "a.idx"] and IndexedDataset(prefix)[0].tolist() == [3, 4, 5]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts this process's descriptors in /proc")
@pytest.mark.parametrize("end", ["finish", "abort"])
@pytest.mark.parametrize("locks", [True, False], ids=["locks", "no-locks"])
def test_a_writer_that_is_done_holds_no_descriptor(tmp_path, monkeypatch, end, locks):
    """The lock that keeps a writer's temporaries from the sweep is let go once it has published or
    aborted: held on, it cost one descriptor per shard for the life of the process, which a merge or
    a preprocess of many keys runs out of (planted: no unlock on either way out). On a file system
    that takes no locks the writer keeps no descriptor either, and writes as ever (planted: the
    descriptor of a lock refused left open; no lock recorded as one)."""
    if not locks:
        monkeypatch.setattr(file_locks, "lock", lambda fd, wait: False)
    before = len(os.listdir("/proc/self/fd"))
    writer = IndexedDatasetWriter(str(tmp_path / "a"), np.uint16)
    writer.add_document([1, 2])
    getattr(writer, end)()
    assert len(os.listdir("/proc/self/fd")) == before


def test_the_index_appears_only_after_its_data(tmp_path, monkeypatch):
    """The .idx names the .bin's contents: renamed first, a crash before the .bin's rename would
    leave a new index over an old (or no) data file."""
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("killed between the renames")
        real(src, dst)
    monkeypatch.setattr(indexed.os, "replace", replace)
    with pytest.raises(OSError):
        write(tmp_path / "a")
    assert calls[0].endswith(".bin") and not os.path.exists(tmp_path / "a.idx")


def test_writers_that_may_not_replace_keep_the_first_shard_published(tmp_path, monkeypatch):
    """Two writers on one prefix at once, in processes with the same id (ranks on two nodes, each in
    its own container): each writes its own temporary files, and the second to publish stops with a
    FileExistsError naming the file, keeping the first's shard and none of its own files. A writer
    allowed to replace still does. (Planted: temporary names from the process id alone; publishing
    by rename.)"""
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    prefix = str(tmp_path / "s")
    first, second = (IndexedDatasetWriter(prefix, np.uint16, replace=False) for _ in range(2))
    first.add_document([1, 2, 3])
    second.add_document([9] * 5)
    first.finish()
    with pytest.raises(FileExistsError, match=rf"^{prefix}.bin: appeared while this run was writing it .*"
                                              "give a new output prefix$"):
        second.finish()
    assert sorted(os.listdir(tmp_path)) == ["s.bin", "s.idx"]
    assert list(IndexedDataset(prefix).sizes) == [3] and list(IndexedDataset(prefix)[0]) == [1, 2, 3]
    write(prefix, [[4]])  # the default writer replaces
    assert list(IndexedDataset(prefix).sizes) == [1]


def test_a_replacing_writer_killed_between_its_renames_leaves_no_stale_index(tmp_path, monkeypatch):
    """The same six tokens in documents of other lengths replace a shard; killed after its ``.bin``
    was renamed into place, the writer must not leave the old ``.idx`` beside the new ``.bin``, which
    would read it with the old document boundaries (the two ``.bin`` files are of a size). (Planted:
    the old ``.idx`` left in place until its replacement's rename.)"""
    prefix = str(tmp_path / "s")
    write(prefix, [[1, 2, 3], [4, 5, 6]])
    rename = os.replace

    def replace(src, dst):
        if str(dst).endswith(".idx"):
            raise Killed
        rename(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(IndexedDatasetWriter, "abort", lambda self: None)
    with pytest.raises(Killed):
        write(prefix, [[7, 8], [9, 10, 11, 12]])
    assert os.path.getsize(f"{prefix}.bin") == 12 and not os.path.exists(f"{prefix}.idx")


@pytest.mark.parametrize("links", [True, False])
def test_put_new_moves_a_file_only_to_a_free_name(tmp_path, monkeypatch, links):
    """``put_new`` moves the file whole or raises FileExistsError and changes nothing, also on a file
    system without hard links (its claim-then-rename path). (Planted: the fallback renaming without
    the exclusive claim.)"""
    import errno

    from data_pipeline.paths import put_new

    if not links:
        def no_links(src, dst):
            raise OSError(errno.EPERM, "Operation not permitted")
        monkeypatch.setattr(os, "link", no_links)
    tmp, final = tmp_path / "a.tmp", tmp_path / "a"
    tmp.write_bytes(b"new")
    final.write_bytes(b"old")
    with pytest.raises(FileExistsError):
        put_new(str(tmp), str(final))
    assert final.read_bytes() == b"old" and tmp.read_bytes() == b"new"
    final.unlink()
    put_new(str(tmp), str(final))
    assert final.read_bytes() == b"new" and not tmp.exists()
    if not links:  # a rename that fails after the claim leaves no empty claim behind to block the next run
        tmp.write_bytes(b"newer")
        final.unlink()

        def failing(src, dst):
            raise OSError(errno.EIO, "Input/output error")
        monkeypatch.setattr(os, "replace", failing)
        with pytest.raises(OSError, match="Input/output error"):
            put_new(str(tmp), str(final))
        assert not final.exists() and tmp.read_bytes() == b"newer"


@pytest.mark.parametrize("replace", [True, False], ids=["replacing", "not replacing"])
@pytest.mark.parametrize("ext", [".bin", ".idx"])
def test_a_folder_where_a_shard_file_goes_is_one_line_before_any_work(tmp_path, replace, ext):
    """A folder at the shard's ``.idx`` (or ``.bin``) path: a replacing writer stopped on it with a bare
    IsADirectoryError traceback once the shard was written, and one that may not replace blamed another
    run for it. Both refuse it as they start, naming it, and a folder made while they write as they
    publish, keeping none of their files. (Planted: no check at either point.)"""
    prefix, folder = tmp_path / "s", tmp_path / f"s{ext}"
    refused = rf"^{folder}: is a folder, where the shard's file goes; remove the folder or give a new output prefix$"
    folder.mkdir()
    with pytest.raises(FileExistsError, match=refused):
        IndexedDatasetWriter(str(prefix), np.uint16, replace=replace)
    folder.rmdir()
    with pytest.raises(FileExistsError, match=refused), IndexedDatasetWriter(str(prefix), np.uint16, replace) as w:
        w.add_document([1, 2, 3])
        folder.mkdir()
    assert os.listdir(tmp_path) == [folder.name]


def record_lock(fd: int, wait: bool) -> bool:
    """``file_locks.lock`` as NFS takes it: a POSIX record lock on the whole file, which only a descriptor
    open for writing can take, which a process never conflicts with itself on, and which it drops as
    it closes any descriptor of that file."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


SWEEP_ELSEWHERE = """
import sys
sys.path.insert(0, sys.argv[1])
from data_pipeline import file_locks, indexed
from tests.test_data_indexed_writes import record_lock
file_locks.lock = record_lock
indexed.remove_stale_temporaries(sys.argv[2])
"""


def test_writers_keep_their_temporaries_where_locks_are_per_process(tmp_path, monkeypatch):
    """On NFS a lock is a POSIX record lock: the writer's lock, taken on a descriptor open for reading,
    was refused, so a killed writer's temporaries were never swept there (planted: the sweep or the
    writer opening for reading); a writer's own sweep took the lock of another writer of the process
    and removed its files (planted: no record of the temporaries held here); and closing the .bin's
    separate descriptor at seal dropped its lock, for another process's sweep to take (planted: the
    tokens written through a descriptor of their own). Each writer keeps its files, and publishes."""
    prefix = str(tmp_path / "a")
    _kill_a_writer(prefix, "after seal")
    monkeypatch.setattr(file_locks, "lock", record_lock)
    sealed = IndexedDatasetWriter(prefix, np.uint16)
    assert _names(tmp_path) == ["a.bin.tmp"]  # the killed writer's swept
    sealed.add_document([1, 2])
    sealed.seal()
    writing = IndexedDatasetWriter(prefix, np.uint16)
    writing.add_document([3])
    elsewhere = subprocess.run([sys.executable, "-c", SWEEP_ELSEWHERE, str(Path(__file__).parents[1]), prefix],
                               capture_output=True, text=True)
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert _names(tmp_path) == ["a.bin.tmp", "a.bin.tmp", "a.idx.tmp"]
    sealed.finish()
    writing.abort()
    assert _names(tmp_path) == ["a.bin", "a.idx"] and IndexedDataset(prefix)[0].tolist() == [1, 2]


def test_another_users_killed_writer_is_swept(tmp_path, monkeypatch):
    """A killed writer's temporaries owned by another user (a shared, group-writable data folder) cannot
    be opened for writing; the sweep opening them only so left a multi-GB .bin.tmp for ever (planted:
    no read-only retry). The refusal is simulated: the tests run as root."""
    prefix = str(tmp_path / "a")
    _kill_a_writer(prefix, "after seal")
    real_open = os.open

    def not_ours(path, flags, *args):
        if ".tmp-" in str(path) and flags & os.O_RDWR and not flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", not_ours)
    IndexedDatasetWriter(prefix, np.uint16).abort()
    assert _names(tmp_path) == []
    # in a sticky folder (/tmp's mode) only the owner may remove it: the sweep leaves it, and the writer
    # starts (planted: the refused unlink raised, and no shard could be written there)
    _kill_a_writer(prefix, "after seal")
    real_unlink = os.unlink

    def sticky(path, *args, **kwargs):
        if ".tmp-" in str(path):
            raise PermissionError(1, "Operation not permitted", path)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", sticky)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_document([1])
        monkeypatch.setattr(os, "unlink", real_unlink)
    assert _names(tmp_path) == ["a.bin", "a.bin.tmp", "a.idx", "a.idx.tmp"]


def _swept_by_another_process(prefix: str) -> None:
    """``remove_stale_temporaries`` as another process runs it: this one's writers' files are not its
    own, so it judges them by their locks alone."""
    held = set(indexed._HELD_HERE)
    indexed._HELD_HERE.clear()
    try:
        indexed.remove_stale_temporaries(prefix)
    finally:
        indexed._HELD_HERE.update(held)


@pytest.mark.parametrize("made", [1, 2], ids=[".bin", ".idx"])
def test_a_sweep_between_a_temporarys_creation_and_its_lock_leaves_the_writer_whole(tmp_path, monkeypatch, made):
    """Another writer of the prefix, starting just as this one makes a temporary, sweeps it before this
    one has locked it: the .bin one was removed, and the writer wrote on into an unlinked file, then
    failed as it published with an error blaming the disk (planted: the name not checked once the
    lock is held, so the writer goes on with a file it does not hold, which the next sweep takes). The
    .idx one is kept by the .bin's lock (planted: an .idx judged by its own lock beside its .bin).
    Either way the writer's files are held from then on, and it publishes its shard whole."""
    prefix, lock = str(tmp_path / "a"), file_locks.lock
    waits = []

    def sweep_first(fd, wait):
        waits.append(wait)  # the writer waits for the lock on its new file; a sweep never waits
        if wait and waits.count(True) == made:
            _swept_by_another_process(prefix)
        return lock(fd, wait)

    monkeypatch.setattr(file_locks, "lock", sweep_first)
    writer = IndexedDatasetWriter(prefix, np.uint16)
    writer.add_document([1, 2, 3])
    writer.seal()
    assert waits.count(False) == 1  # the sweep judged the writer's .bin temporary by its lock
    _swept_by_another_process(prefix)  # a later writer's
    writer.publish()
    assert _names(tmp_path) == ["a.bin", "a.idx"] and IndexedDataset(prefix)[0].tolist() == [1, 2, 3]
