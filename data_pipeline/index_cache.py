"""Build-once caching of index arrays as ``.npy`` files, keyed by a hash of what they describe.

Several ranks (or several jobs) may ask for the same indices at the same time. Without
torch.distributed here, a file lock decides: the first process to take it builds and writes, the
others block on the lock and then find the files and load them (where the file system gives no
locks, each builds them). Files are written under temporary names and put in place whole, only where
none is there yet, and a description ``.json`` is written last, so its presence means complete.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
from collections.abc import Callable

import numpy as np

from data_pipeline.paths import put_new, temp_name


def default_cache_dir(prefix: str) -> str:
    """``index-cache`` in the folder of the shard ``prefix``."""
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "index-cache")


def description_hash(description: dict) -> str:
    return hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()


class CacheWriteError(OSError):
    """The cache itself cannot be written (a full disk, a read-only folder): told apart from an
    ``OSError`` of ``build``, which reads the data, so that neither is reported as the other."""


def cached_arrays(cache_dir: str, kind: str, description: dict, names: tuple[str, ...],
                  build: Callable[[], dict]) -> dict:
    """Load ``names`` for this description from ``cache_dir``, building them first if absent.

    ``build()`` returns a dict of numpy arrays with exactly ``names`` as keys. Loaded arrays are
    memory-mapped read-only, so every rank shares one copy in the page cache. Writing the cache (its
    folder, lock and files) raises ``CacheWriteError``.
    """
    with _writing(cache_dir):
        os.makedirs(cache_dir, exist_ok=True)
    stem = os.path.join(cache_dir, f"{description_hash(description)}-{kind}")
    done = f"{stem}-description.json"
    paths = {n: f"{stem}-{n}.npy" for n in names}

    def complete() -> bool:  # a file deleted from the cache (by hand, or a cleaner) is built again
        return os.path.exists(done) and all(map(os.path.exists, paths.values()))

    if not complete():
        with _writing(cache_dir):
            lock = open(f"{stem}.lock", "w")
        with lock, _held(lock):
            if not complete():
                arrays = build()
                with _writing(cache_dir):
                    _write(arrays, paths, done, description)
    try:
        return {n: np.load(p, mmap_mode="r") for n, p in paths.items()}
    except (OSError, ValueError, EOFError) as exc:  # truncated (to nothing: EOFError) or overwritten
        raise ValueError(f"{stem}-*.npy: a cached index file cannot be read ({exc}); delete the files {stem}-* "
                         "(or the cache directory) and run again to rebuild them") from None


NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL)
"""What ``flock`` fails with on a file system that takes no locks: NFS without its lock service
(ENOLCK), Lustre mounted without flock support (ENOSYS), FUSE file systems (EOPNOTSUPP, EINVAL)."""


@contextlib.contextmanager
def _held(lock):
    """The block under an exclusive lock on the open file ``lock``, or without one where the file
    system has none to give (``NO_LOCKS``: NFS without its lock service, Lustre mounted without
    flock, some FUSE file systems): every process then
    builds the arrays itself, which costs time but not correctness: each file is put in place whole,
    and only where none is there yet (``_kept_if_there``)."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        locked = True
    except OSError as exc:
        if exc.errno not in NO_LOCKS:
            raise OSError(exc.errno, f"{lock.name}: cannot be locked ({exc.strerror})") from None
        locked = False  # the build's own errors are not raised inside this handler, which would chain them
    try:
        yield
    finally:
        if locked:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write(arrays: dict, paths: dict, done: str, description: dict) -> None:
    if set(arrays) != set(paths):
        raise ValueError(f"index builder returned {sorted(arrays)}, expected {sorted(paths)}")
    for name, path in paths.items():
        with _kept_if_there(path, ".npy") as tmp:
            np.save(tmp, arrays[name], allow_pickle=False)
    with _kept_if_there(done) as tmp, open(tmp, "w") as f:
        json.dump(description, f, indent=1, sort_keys=True)


@contextlib.contextmanager
def _kept_if_there(path: str, suffix: str = ""):
    """A temporary name beside ``path`` for the block to write, put at ``path`` whole unless a file is
    there already, which is kept: the same description builds the same arrays, and another process
    may have that file memory-mapped (replaced on NFS, its pages go stale under it: a bus error). On a
    file system without hard links and without locks, ``put_new`` claims the name empty first, which
    a process loading at that moment reads as a damaged file (named, with what to delete)."""
    tmp = temp_name(path, suffix)
    try:
        yield tmp
        with contextlib.suppress(FileExistsError):
            put_new(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@contextlib.contextmanager
def _writing(cache_dir: str):
    """An ``OSError`` of the block, raised as ``CacheWriteError`` naming ``cache_dir``."""
    try:
        yield
    except CacheWriteError:
        raise
    except OSError as exc:
        raise CacheWriteError(f"{cache_dir}: {exc.strerror or exc}") from exc
