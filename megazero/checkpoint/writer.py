"""Saving a checkpoint from every rank at once, atomically, optionally in the background.

Protocol (every rank calls ``save`` for the same step, at the same point of the program)::

    rank 0   clear a stale ROOT/step_N.tmp left by a crash, create it      -- barrier --
    all      write own files into step_N.tmp/, each hashed while written,
             fsync, then own manifest.rankR.json                           (background if async)
                                                                           -- barrier --  (in wait())
    rank 0   check every rank's manifest, write COMPLETE, rename step_N.tmp -> step_N,
             replace ROOT/latest, delete checkpoints beyond keep_last;
             or, if any rank failed, remove step_N.tmp                      -- barrier --
    all      confirm step_N/COMPLETE exists (else raise)

A save that fails anywhere (a full disk, a read-only mount, lost permissions) fails on every rank
with one ``CheckpointError`` naming the directory and the rank, and the reason in words on the rank
it happened to; given ``gather`` (every rank's value, in rank order), every rank raises that rank's
own words, marked agreed, so a launch prints the cause once, not a line a rank. The partial
directory is removed (a full disk is not left fuller) and the previous complete checkpoint stays
the latest (a ``latest`` that cannot be replaced undoes the rename). Every
rank still passes every barrier, so none is left waiting. Only removing older checkpoints may fail
after the commit: that is a warning, since the new checkpoint is complete.

The ranks must share a filesystem: rank 0 renames a directory the others wrote into. The barrier and
the gather are injected (``dist.barrier`` and ``dist.all_gather_object`` in the trainer, a
``threading.Barrier`` in tests) so this module needs no process group; they are only ever called
from the thread that calls ``save`` and ``wait``, so they never race the training loop's own
collectives.

Asynchronous saves copy every tensor to CPU (pinned memory when CUDA is present) before ``save``
returns -- training may then overwrite the originals -- and write the files in a thread. The
checkpoint is finished by ``wait()``, which every rank must call at the same point: ``save`` calls it
for the previous checkpoint, and the trainer calls it before exiting. Until then the previous
complete checkpoint is the latest.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from megazero.checkpoint import serialization
from megazero.checkpoint.format import (
    COMPLETE, FORMAT_VERSION, LATEST, CheckpointError, HashingWriter, complete_text, fsync_dir, list_checkpoints,
    os_error_words, rank_manifest_name, read_json, step_dir_name, write_text_atomic,
)

DISCARDED = "the partial checkpoint was removed and the previous one, if any, is still the latest"


def _snapshot(obj: Any) -> Any:
    """A private CPU copy of ``obj`` that training can no longer change (dicts and lists rebuilt,
    tensors copied; the other values a checkpoint file may hold are immutable)."""
    import torch

    if isinstance(obj, dict):
        return {key: _snapshot(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_snapshot(value) for value in obj]
    if not isinstance(obj, torch.Tensor):
        return obj
    if obj.device.type == "cpu":
        return obj.detach().clone()
    copy_ = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=torch.cuda.is_available())
    copy_.copy_(obj.detach(), non_blocking=True)
    return copy_


def _check_name(name: str) -> None:
    """A file name must name one file of its own inside the checkpoint: written as the manifest
    records it (``./a.pt``, ``sub//a.pt`` or ``sub/`` is another spelling of a name, which the
    commit's check of names unique across ranks would miss), and clear of the files a save writes
    itself (``COMPLETE``, the manifests, and their temporaries)."""
    if (any(part in ("", ".", "..") for part in name.split("/")) or name.startswith("manifest.")
            or name in (COMPLETE, COMPLETE + ".tmp")):
        raise ValueError(f"checkpoint file name {name!r} must be a relative path inside the checkpoint, written "
                         f"without '..', '.', empty parts or a trailing '/', and not {COMPLETE}, {COMPLETE}.tmp "
                         "or manifest.*")


class _UnfinishedRank(CheckpointError):
    """Rank 0 found another rank's files unfinished: that rank's own error gives the cause."""


def _reason(e: Exception) -> str:
    return os_error_words(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"


class CheckpointWriter:
    """Writes this rank's part of each checkpoint under ``root`` and, on rank 0, commits it."""

    def __init__(self, root: str | os.PathLike, *, rank: int, world_size: int, barrier: Callable[[], None],
                 keep_last: int = 3, async_save: bool = False, gather: Optional[Callable[[Any], list]] = None):
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.root = Path(root)
        self.rank, self.world_size, self.barrier, self.gather = rank, world_size, barrier, gather
        self.keep_last, self.async_save = keep_last, async_save
        self._pending: Optional[tuple[int, Optional[dict], threading.Thread, list]] = None
        self.committed_step: Optional[int] = None  # the newest step this writer completed on disk

    @property
    def pending_step(self) -> Optional[int]:
        """The step whose save is written (in the background, with ``async_save``) but not yet
        committed: a process that ends before the next ``wait`` loses it."""
        return None if self._pending is None else self._pending[0]

    def save(self, step: int, files: Mapping[str, Any], meta: Optional[dict] = None) -> None:
        """Save this rank's ``files`` (relative name -> a tree of tensors, dicts, lists, strings,
        numbers, booleans and None; see ``serialization``) as part of ``step``.

        Names must be unique across ranks (put the rank or layout position in them). ``meta`` is a
        JSON-serialisable dict recorded in ``COMPLETE``; only rank 0's is kept. Collective: every rank
        calls it. With ``async_save`` it returns once the tensors are copied; see ``wait``.
        """
        for name in files:
            _check_name(name)
        self.wait()
        tmp = self._tmp(step)
        errors: list = []
        if self.rank == 0:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)  # a save of this step that died part-way
                tmp.mkdir(parents=True)
            except OSError as e:
                errors.append(CheckpointError(f"{tmp}: rank 0 could not create this checkpoint directory: "
                                              f"{_reason(e)}; {DISCARDED}"))
        self.barrier()
        thread = None
        if not errors and tmp.is_dir():  # else rank 0 could not create it, and its error says why
            if self.async_save:
                snapshot = {name: _snapshot(obj) for name, obj in files.items()}
                _synchronize_cuda()
                thread = threading.Thread(target=self._write_files, args=(tmp, step, snapshot, errors),
                                          name=f"checkpoint-{step}", daemon=True)
                thread.start()
            else:
                self._write_files(tmp, step, files, errors)
        self._pending = (step, meta, thread, errors)
        if not self.async_save:
            self.wait()

    def wait(self) -> Optional[Path]:
        """Finish the pending save, if any: returns its directory. Collective, like ``save``."""
        if self._pending is None:
            return None
        step, meta, thread, errors = self._pending
        self._pending = None
        if thread is not None:
            thread.join()
        self.barrier()  # every rank has written its files, or failed to
        tmp = self._tmp(step)
        points_elsewhere = False  # rank 0's error only says another rank failed, which says why itself
        if self.rank == 0:
            if not errors:
                try:
                    self._commit(step, meta)
                except CheckpointError as e:  # a rank's files are missing, or two ranks wrote one name
                    errors.append(CheckpointError(f"{e}; {DISCARDED}"))
                    points_elsewhere = isinstance(e, _UnfinishedRank)
                except Exception as e:  # noqa: BLE001 - re-raised after the barrier, so no rank is left waiting
                    errors.append(CheckpointError(f"{tmp}: rank 0 could not complete this checkpoint: "
                                                  f"{_reason(e)}; {DISCARDED}"))
            if errors:
                shutil.rmtree(tmp, ignore_errors=True)
        self.barrier()
        if self.gather is not None:
            told = [e for e in self.gather((str(errors[0]), points_elsewhere) if errors else None) if e is not None]
            if told:  # every rank raises the first cause found on its own rank
                raise CheckpointError(next((text for text, elsewhere in told if not elsewhere), told[0][0]),
                                      agreed=True)
        if errors:
            raise errors[0]
        final = self.root / step_dir_name(step)
        if not (final / COMPLETE).is_file():
            raise CheckpointError(f"{tmp}: rank 0 could not complete this checkpoint (its error names the rank "
                                  f"that failed and why); {DISCARDED}")
        self.committed_step = step
        return final

    def _tmp(self, step: int) -> Path:
        return self.root / (step_dir_name(step) + ".tmp")

    def _write_files(self, tmp: Path, step: int, files: Mapping[str, Any], errors: list) -> None:
        try:
            entries = {}
            for name, obj in files.items():
                path = tmp / name
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "wb") as f:
                    writer = HashingWriter(f)
                    serialization.write(obj, writer)
                    f.flush()
                    os.fsync(f.fileno())
                entries[name] = {"rank": self.rank, "bytes": writer.bytes, "sha256": writer.sha256.hexdigest()}
            # the entries of files in subfolders (and of those subfolders) are durable only once their
            # folders are fsynced; ``tmp``'s own are when the manifest is written into it
            for folder in sorted({p for name in files for p in (tmp / name).parents if tmp in p.parents}, reverse=True):
                fsync_dir(folder)
            record = {"rank": self.rank, "step": step, "files": entries}
            write_text_atomic(tmp / rank_manifest_name(self.rank), json.dumps(record, indent=1))
        except Exception as e:  # noqa: BLE001 - reported by wait() on the calling thread
            errors.append(CheckpointError(f"{tmp}: rank {self.rank} could not write its checkpoint files: "
                                          f"{_reason(e)}; {DISCARDED}"))

    def _commit(self, step: int, meta: Optional[dict]) -> None:
        tmp = self._tmp(step)
        files: dict[str, dict] = {}
        for rank in range(self.world_size):
            if not (tmp / rank_manifest_name(rank)).is_file():
                raise _UnfinishedRank(f"{tmp}: rank {rank} did not finish writing its checkpoint files (its own "
                                      "error says why)")
            record = read_json(tmp / rank_manifest_name(rank), f"rank {rank}'s manifest")
            for name, entry in record["files"].items():
                if name in files:
                    raise CheckpointError(f"{tmp / name}: written by both rank {files[name]['rank']} and rank "
                                          f"{rank}; checkpoint file names must be unique across ranks")
                files[name] = entry
        complete = {"format": FORMAT_VERSION, "step": step, "world_size": self.world_size,
                    "meta": meta or {}, "files": files}
        write_text_atomic(tmp / COMPLETE, complete_text(complete))
        final = self.root / step_dir_name(step)
        old = final.with_name(final.name + RETIRED)
        if final.exists():  # re-saving a step (after a resume): swap, then drop the old copy
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(self.root)
        try:
            write_text_atomic(self.root / LATEST, final.name + "\n")
        except OSError:  # roll back: the pointer still names the previous checkpoint, so must the scan
            os.replace(final, tmp)
            if old.exists():
                os.replace(old, final)
            raise
        self.committed_step = step  # complete on disk, and named by the pointer: what a second Ctrl-C keeps
        shutil.rmtree(old, ignore_errors=True)
        try:
            self._prune(step)
        except OSError as e:  # the new checkpoint is complete: a failed clean-up only costs space
            print(f"megazero: warning: {self.root}: could not remove older checkpoints: {os_error_words(e)}",
                  flush=True)

    def _prune(self, current: int) -> None:
        """Keep the newest ``keep_last`` complete checkpoints (the one just written always among
        them) and clear leftovers of saves that died; runs only after the new one is complete."""
        older = [path for step, path in list_checkpoints(self.root) if step != current]
        for path in older[: max(len(older) - (self.keep_last - 1), 0)]:
            # renamed first: a deletion that stops part-way leaves a leftover, never a step_N without
            # its COMPLETE, which would stop the next launch (``latest_checkpoint``)
            retired = path.with_name(path.name + RETIRED)
            os.replace(path, retired)
            shutil.rmtree(retired)
        for leftover in self.root.glob("step_*.tmp"):
            shutil.rmtree(leftover, ignore_errors=True)
        for leftover in self.root.glob(f"step_*{RETIRED}"):
            shutil.rmtree(leftover, ignore_errors=True)


RETIRED = ".retired-by-megazero"
"""The suffix of a checkpoint the writer set aside to delete (a step saved again, or one past
``keep_last``): a name of its own, since everything under it is deleted without a word, and
``step_N.old`` is what a person names a checkpoint they move aside to keep."""


def _synchronize_cuda() -> None:
    """Wait for the non-blocking device-to-host copies of a snapshot before another thread reads them."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
