"""Locks that tell a live writer's temporary files from those of a writer killed outright.

A writer holds an exclusive lock on each temporary it makes until it has put it in place or removed
it; a later writer of the same output removes ("sweeps") the temporaries whose lock it can take,
which no live writer holds. The locks are ``flock``s, which NFS takes as POSIX record locks: hence
the rules below on which descriptor takes and keeps a lock. Used by the shard writer (``indexed``),
the checkpoint conversion's staging folders and the tokenizer trainer."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterable


class Swept(Exception):
    """A new temporary removed by another writer's sweep before its own writer had locked it."""


def lock(fd: int, wait: bool) -> bool:
    """Take the exclusive lock on the file open at ``fd``; False where the file system takes no locks,
    or (``wait`` off) another descriptor holds it. A writer holds one on each of its temporaries until
    it has published or aborted: what tells its files from those of a killed writer."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def create_locked(tmp: str) -> int:
    """Create the temporary ``tmp`` and return a descriptor that writes it, holding its lock (on a file
    system that takes no locks, none; no sweep removes a temporary there either). The file is written
    through this descriptor alone, never one opened beside it: NFS takes an exclusive lock only on a
    descriptor open for writing, and drops a process's lock when any of its descriptors of the file
    closes; SMB refuses reads and writes of a locked file through any other descriptor.

    No call makes a file and locks it in one step: between the two, a sweep by another writer of the
    prefix can take the lock first and remove the file as a killed writer's. The lock is waited for (a
    sweep holds it only to remove the file), then ``tmp`` is checked to hold the locked file still:
    raises ``Swept`` where it does not. Once locked, it is safe from every sweep."""
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        if not lock(fd, wait=True):
            return fd
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(tmp)):
                return fd
        raise Swept(tmp)
    except BaseException:
        os.close(fd)
        raise


def try_lock(tmp: str) -> int | None:
    """A descriptor holding the lock on the temporary ``tmp`` (``lock``), or None where it cannot be
    had (the file gone, the lock held, a file system that takes no locks): what the sweep asks."""
    try:
        fd = os.open(tmp, os.O_RDWR)  # NFS takes an exclusive lock only on a descriptor open for writing
    except PermissionError:  # another user's, in a shared folder: a local flock locks it through a reading
        # descriptor (NFS's record lock does not, so there it is kept)
        try:
            fd = os.open(tmp, os.O_RDONLY)
        except OSError:
            return None
    except OSError:
        return None
    if not lock(fd, wait=False):
        os.close(fd)
        return None
    return fd


def remove_abandoned(lock_file: str, paths: Iterable[str]) -> None:
    """Remove ``paths`` (files, or folders with all they hold) where the lock on ``lock_file`` can be
    taken (``try_lock``): no live writer holds it, so they are what a writer killed outright left."""
    fd = try_lock(lock_file)
    if fd is None:
        return  # a live writer's, done meanwhile, or on a file system without locks
    try:
        for path in paths:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError, PermissionError):  # another user's, in a sticky folder
                    os.unlink(path)
    finally:
        os.close(fd)
