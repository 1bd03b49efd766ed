"""Saving a checkpoint from every rank at once, atomically, optionally in the background.

Protocol (every rank calls ``save`` for the same step, at the same point of the program)::

    rank 0   clear a stale ROOT/step_N.tmp left by a crash, create it      -- barrier --
    all      write own files into step_N.tmp/, each hashed while written,
             fsync, then own manifest.rankR.json                           (background if async)
                                                                           -- barrier --  (in wait())
    rank 0   check every rank's manifest, write COMPLETE, rename step_N.tmp -> step_N,
             replace ROOT/latest, delete checkpoints beyond keep_last      -- barrier --
    all      confirm step_N/COMPLETE exists (else raise)

The ranks must share a filesystem: rank 0 renames a directory the others wrote into. The barrier is
injected (``lambda: dist.barrier(group)`` in the trainer, ``threading.Barrier(n).wait`` in tests) so
this module needs no process group; it is only ever called from the thread that calls ``save`` and
``wait``, so it never races the training loop's own collectives.

Asynchronous saves copy every tensor to CPU (pinned memory when CUDA is present) before ``save``
returns -- training may then overwrite the originals -- and write the files in a thread. The
checkpoint is finished by ``wait()``, which every rank must call at the same point: ``save`` calls it
for the previous checkpoint, and the trainer calls it before exiting. Until then the previous
complete checkpoint is the latest.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from megazero.checkpoint.format import (
    COMPLETE, FORMAT_VERSION, LATEST, CheckpointError, HashingWriter, fsync_dir, list_checkpoints,
    rank_manifest_name, read_json, step_dir_name, write_text_atomic,
)


def _map_tensors(obj: Any, fn: Callable) -> Any:
    """Rebuild dicts, lists and tuples with ``fn`` applied to every other value (tensors among them)."""
    if isinstance(obj, dict):
        rebuilt = copy.copy(obj)  # keeps the type and attributes (a state_dict's ``_metadata``)
        rebuilt.clear()
        rebuilt.update((k, _map_tensors(v, fn)) for k, v in obj.items())
        return rebuilt
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return fn(obj)


def _compact(obj: Any) -> Any:
    """Clone tensors that view a larger storage: torch.save writes the whole storage otherwise, so a
    ZeRO shard that views a flat buffer would save the full buffer."""
    import torch

    if isinstance(obj, torch.Tensor) and obj.untyped_storage().nbytes() > obj.numel() * obj.element_size():
        return obj.detach().clone()
    return obj


def _snapshot(obj: Any) -> Any:
    """A private CPU copy of ``obj`` that training can no longer change."""
    import torch

    if not isinstance(obj, torch.Tensor):
        return copy.deepcopy(obj)
    if obj.device.type == "cpu":
        return obj.detach().clone()
    copy_ = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=torch.cuda.is_available())
    copy_.copy_(obj.detach(), non_blocking=True)
    return copy_


def _check_name(name: str) -> None:
    parts = Path(name).parts
    if not name or Path(name).is_absolute() or ".." in parts or name.startswith("manifest.") or name == COMPLETE:
        raise ValueError(f"checkpoint file name {name!r} must be a relative path inside the checkpoint, "
                         f"without '..', and not {COMPLETE} or manifest.*")


class CheckpointWriter:
    """Writes this rank's part of each checkpoint under ``root`` and, on rank 0, commits it."""

    def __init__(self, root: str | os.PathLike, *, rank: int, world_size: int, barrier: Callable[[], None],
                 keep_last: int = 3, async_save: bool = False):
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.root = Path(root)
        self.rank, self.world_size, self.barrier = rank, world_size, barrier
        self.keep_last, self.async_save = keep_last, async_save
        self._pending: Optional[tuple[int, Optional[dict], threading.Thread, list]] = None

    def save(self, step: int, files: Mapping[str, Any], meta: Optional[dict] = None) -> None:
        """Save this rank's ``files`` (relative name -> object for ``torch.save``) as part of ``step``.

        Names must be unique across ranks (put the rank or layout position in them). ``meta`` is a
        JSON-serialisable dict recorded in ``COMPLETE``; only rank 0's is kept. Collective: every rank
        calls it. With ``async_save`` it returns once the tensors are copied; see ``wait``.
        """
        for name in files:
            _check_name(name)
        self.wait()
        tmp = self.root / (step_dir_name(step) + ".tmp")
        if self.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)  # a save of this step that died part-way
            tmp.mkdir(parents=True)
        self.barrier()
        errors: list = []
        if self.async_save:
            snapshot = {name: _map_tensors(obj, _snapshot) for name, obj in files.items()}
            _synchronize_cuda()
            thread = threading.Thread(target=self._write_files, args=(tmp, step, snapshot, errors),
                                      name=f"checkpoint-{step}", daemon=True)
            thread.start()
        else:
            thread = None
            self._write_files(tmp, step, {name: _map_tensors(obj, _compact) for name, obj in files.items()}, errors)
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
        self.barrier()
        if self.rank == 0 and not errors:
            try:
                self._commit(step, meta)
            except Exception as e:  # noqa: BLE001 - re-raised after the barrier, so no rank is left waiting
                errors.append(e)
        self.barrier()
        if errors:
            raise errors[0]
        final = self.root / step_dir_name(step)
        if not (final / COMPLETE).is_file():
            raise CheckpointError(f"{final}: rank 0 could not complete this checkpoint (see its error); "
                                  "the previous checkpoint is still the latest")
        return final

    def _write_files(self, tmp: Path, step: int, files: Mapping[str, Any], errors: list) -> None:
        import torch

        try:
            entries = {}
            for name, obj in files.items():
                path = tmp / name
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "wb") as f:
                    writer = HashingWriter(f)
                    torch.save(obj, writer)
                    f.flush()
                    os.fsync(f.fileno())
                entries[name] = {"rank": self.rank, "bytes": writer.bytes, "sha256": writer.sha256.hexdigest()}
            record = {"rank": self.rank, "step": step, "files": entries}
            write_text_atomic(tmp / rank_manifest_name(self.rank), json.dumps(record, indent=1))
        except Exception as e:  # noqa: BLE001 - reported by wait() on the calling thread
            errors.append(CheckpointError(f"{tmp}: rank {self.rank} failed to write its checkpoint files: {e!r}"))

    def _commit(self, step: int, meta: Optional[dict]) -> None:
        tmp = self.root / (step_dir_name(step) + ".tmp")
        files: dict[str, dict] = {}
        for rank in range(self.world_size):
            record = read_json(tmp / rank_manifest_name(rank), f"rank {rank}'s manifest (did rank {rank} save?)")
            for name, entry in record["files"].items():
                if name in files:
                    raise CheckpointError(f"{tmp / name}: written by both rank {files[name]['rank']} and rank "
                                          f"{rank}; checkpoint file names must be unique across ranks")
                files[name] = entry
        complete = {"format": FORMAT_VERSION, "step": step, "world_size": self.world_size,
                    "meta": meta or {}, "files": files}
        write_text_atomic(tmp / COMPLETE, json.dumps(complete, indent=1))
        final = self.root / step_dir_name(step)
        old = final.with_name(final.name + ".old")
        if final.exists():  # re-saving a step (after a resume): swap, then drop the old copy
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(self.root)
        write_text_atomic(self.root / LATEST, final.name + "\n")
        shutil.rmtree(old, ignore_errors=True)
        self._prune(step)

    def _prune(self, current: int) -> None:
        """Keep the newest ``keep_last`` complete checkpoints (the one just written always among
        them) and clear leftovers of saves that died; runs only after the new one is complete."""
        older = [path for step, path in list_checkpoints(self.root) if step != current]
        for path in older[: max(len(older) - (self.keep_last - 1), 0)]:
            shutil.rmtree(path)
        for leftover in self.root.glob("step_*.tmp"):
            shutil.rmtree(leftover, ignore_errors=True)
        for leftover in self.root.glob("step_*.old"):
            shutil.rmtree(leftover, ignore_errors=True)


def _synchronize_cuda() -> None:
    """Wait for the non-blocking device-to-host copies of a snapshot before another thread reads them."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
