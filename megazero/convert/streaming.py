"""Safetensors files written tensor by tensor, and folders that appear at their final path only whole.

``serialization.write`` takes a whole tree of tensors in memory; a converted 7B model's flat master
shard alone is 27 GiB. Here the header is written first from the tensors' shapes (meta tensors
stand in for them, so ``serialization.split`` names them exactly as a training rank's file does)
and the bytes follow one piece at a time, hashed on the way. The result reads back with
``serialization.read`` and the safetensors library like any other checkpoint file.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from data_pipeline import file_locks
from data_pipeline.paths import make_folders, remove_made
from megazero.checkpoint import serialization
from megazero.checkpoint.format import HashingWriter, fsync_dir, os_error_words
from megazero.errors import UserError

OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""The write errors of a destination that cannot hold the conversion (a full disk, a quota, a file-size
limit): a one-line error naming DST, not a traceback from deep inside a tensor's write."""


class StreamedSafetensors:
    """Write a safetensors file whose tensors are declared up front and then arrive, in declared
    order, in pieces of any size; ``close`` checks that every declared byte was written."""

    def __init__(self, path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]):
        self.path = path
        self.f = open(path, "wb")
        self.writer = HashingWriter(self.f)
        self.pending = [(name, t.dtype, t.numel() * t.element_size()) for name, t in tensors.items()]
        self.writer.write(serialization.header(tensors, metadata))
        self.left = 0  # bytes still owed to the current tensor
        self.current: Optional[tuple[str, torch.dtype, int]] = None

    def write(self, piece: torch.Tensor) -> None:
        """The next elements of the current tensor (or the start of the next one)."""
        name, dtype = self._take(piece.numel())
        data = cast_checked(piece, dtype, name).contiguous().reshape(-1).view(torch.uint8).numpy()
        self.writer.write(memoryview(data))
        self.left -= len(data)

    def write_zeros(self, numel: int) -> None:
        """The next ``numel`` elements of the current tensor are zeros: left as a hole in the file, so
        fresh optimizer moments cost neither disk blocks nor writes (they are still hashed)."""
        if numel == 0:
            return
        _, dtype = self._take(numel)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self.writer.skip_zeros(nbytes)
        self.left -= nbytes

    def _take(self, numel: int) -> tuple[str, torch.dtype]:
        """The tensor the next ``numel`` elements belong to, checked against what it still owes."""
        if self.left == 0:
            if not self.pending:
                raise ValueError(f"{self.path}: more data than its header declares")
            self.current = self.pending.pop(0)
            self.left = self.current[2]
        name, dtype, _ = self.current
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes > self.left:
            raise ValueError(f"{self.path}: {name} gets {nbytes} bytes where {self.left} remain")
        return name, dtype

    def close(self) -> dict:
        """Finish the file; returns its manifest entry fields (bytes, sha256). It is synced with the rest
        of DST by ``staged``, before the rename that publishes them."""
        if self.left or self.pending:
            raise ValueError(f"{self.path}: closed with tensors unwritten")
        self.f.truncate()  # a file that ends in a hole ends here
        self.f.close()
        return {"bytes": self.writer.bytes, "sha256": self.writer.sha256.hexdigest()}


def cast_checked(t: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """``t`` in ``dtype``, refused (naming the tensor) where finite values would become inf: fp16
    holds nothing beyond 65,504, and an exported model with inf weights computes NaN."""
    cast = t.detach().to(dtype)
    if cast.dtype != t.dtype and cast.is_floating_point() and not bool(torch.isfinite(cast).all()) \
            and bool(torch.isfinite(t).all()):
        raise UserError(f"{name}: holds values up to {t.abs().max().item():.4g}, beyond what "
                        f"{str(dtype).removeprefix('torch.')} can hold (they would be written as inf); "
                        "write it as bf16 or fp32 (--dtype)")
    return cast


def declare(tree: Any) -> tuple[str, dict[str, torch.Tensor]]:
    """The ``serialization`` metadata of ``tree`` and its tensors by path, in file order; tensors may
    be meta tensors standing in for data written later."""
    tensors: dict[str, torch.Tensor] = {}
    return json.dumps(serialization.split(tree, "", tensors)), tensors


def _make_durable(root: Path) -> None:
    """fsync every file and folder under ``root`` before the rename publishes it: after a power loss
    a published DST must not hold empty files or miss entries. One pass for every file the writers
    made (weights, index, manifests, ``COMPLETE``), as the training checkpoint's writer syncs before
    its rename."""
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(folder))


@contextmanager
def staged(dst: Path, single_file: bool = False) -> Iterator[Path]:
    """A fresh folder beside ``dst`` to write into; renamed to ``dst`` when the block succeeds (with
    ``single_file``, the file of ``dst``'s name inside it is), removed when it fails, so ``dst``
    never holds a partial result, with the folders made above it for the purpose. Refuses an
    existing ``dst``. The folder gets the permissions a plain ``mkdir`` would (``mkdtemp`` makes it
    private to its owner, which the rename kept: others sharing a cluster could not read a checkpoint
    converted for them).

    A conversion killed outright (SIGKILL, the OOM killer) leaves its folder, a whole checkpoint's
    size, which nothing removed; each is now locked while its conversion lives (``STAGING_LOCK``,
    ``data_pipeline.file_locks``), and the next conversion to the same ``dst`` removes those whose
    lock it can take."""
    dst = Path(dst)
    if dst.exists():
        raise UserError(f"{dst}: already exists; give a new DST path or remove it first")
    made: list[str] = []
    held = None
    try:
        made = make_folders(str(dst.parent))
        _remove_abandoned(dst)
        while held is None:
            tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent))
            tmp.chmod(0o777 & ~_umask())
            with suppress(file_locks.Swept):  # another conversion's sweep took it before it was locked
                held = file_locks.create_locked(str(tmp / STAGING_LOCK))
    except OSError as e:
        remove_made(made)
        raise UserError(f"{dst.parent}: cannot write the conversion here: {os_error_words(e)}") from None
    done = False
    try:
        yield tmp
        # still held, the lock goes first: no sweep finds the folder from here, and the durable pass
        # does not open and close the lock file (which drops an NFS lock)
        os.unlink(tmp / STAGING_LOCK)
        _make_durable(tmp)
        os.rename(tmp / dst.name if single_file else tmp, dst)
        done = True
        fsync_dir(dst.parent)
    except OSError as e:
        if e.errno not in OUT_OF_SPACE:  # only writes fail so; a read of SRC failing otherwise is its own error
            raise
        raise UserError(f"{dst}: cannot be written ({e.strerror}); free space beside it or give a DST on another "
                        "disk") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(held)
        if not done:
            remove_made(made)


STAGING_LOCK = ".converting"
"""The file in a conversion's staging folder whose lock says the conversion is alive (``staged``)."""


def _remove_abandoned(dst: Path) -> None:
    """Remove the staging folders of conversions to ``dst`` killed outright: those whose lock file can
    be locked. A folder without one is just made (or about to be renamed) by a live conversion."""
    for folder in glob.glob(os.path.join(glob.escape(str(dst.parent)), f".{glob.escape(dst.name)}.*.tmp")):
        file_locks.remove_abandoned(os.path.join(folder, STAGING_LOCK), [folder])


def _umask() -> int:
    """The process's file-creation mask (read by setting it, the only way, and setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
