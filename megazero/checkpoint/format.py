"""The on-disk layout of a checkpoint and everything needed to find and read one safely.

A checkpoint root holds one directory per saved step and a pointer to the newest::

    ROOT/
      latest                      text: "step_0001200"; replaced atomically, the last thing a save does
      step_0001200/
        COMPLETE                  JSON: format, step, world_size, caller's meta, every file's
                                  {rank, bytes, sha256}; written only after every rank finished
        manifest.rank00000.json   what rank 0 wrote (the same entries, per rank)
        <files named by the caller, e.g. model/tp0_pp1.pt, optim/rank00003.pt>
      step_0001300.tmp/           a save in progress, or one that died: never loaded

A directory is a checkpoint only if it is named ``step_<digits>`` *and* holds ``COMPLETE``. Because
``COMPLETE`` is written inside the temporary directory before it is renamed, a crash at any moment
leaves either the old set of checkpoints or the old set plus a complete new one -- never a partial
checkpoint under a final name. Loading re-checks every file's size and sha256 against ``COMPLETE``.

Files are ``torch.save`` pickles; they are loaded with ``weights_only=False`` by default because a
training checkpoint holds RNG states and other plain Python objects. Load only checkpoints you trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Optional

from megazero.errors import UserError

FORMAT_VERSION = 1
COMPLETE = "COMPLETE"
LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d+)$")
CHUNK = 1 << 20


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete or damaged; the message names the path."""


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def rank_manifest_name(rank: int) -> str:
    return f"manifest.rank{rank:05d}.json"


class HashingWriter:
    """A write-only file wrapper that hashes and counts the bytes as ``torch.save`` streams them,
    so a checksum costs no second read of a multi-gigabyte shard."""

    def __init__(self, f):
        self.f, self.sha256, self.bytes = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.bytes += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary sibling, fsync it, then rename it over ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_json(path: Path, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {what} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({e}); the file is damaged") from None


def file_digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


# --- finding checkpoints ------------------------------------------------------------------------

def is_complete(path: Path) -> bool:
    return STEP_DIR.match(path.name) is not None and (path / COMPLETE).is_file()


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, directory), oldest first; partial ones are skipped."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(STEP_DIR.match(p.name).group(1)), p) for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike) -> Optional[Path]:
    """The checkpoint ``ROOT/latest`` names if it is complete, else the complete one with the highest step.

    The pointer is the commit point of a save, so it wins; the scan covers a pointer that is
    missing or names a directory that was deleted by hand.
    """
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text(encoding="utf-8").strip()
        if named.parent == root and is_complete(named):
            return named
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint an explicit ``checkpoint.load`` names: ``path`` itself if it is a complete
    checkpoint directory, else the latest complete one under it.

    Unlike ``latest_checkpoint`` (for the implicit resume from ``save_dir``, where finding nothing
    means a fresh start), finding nothing here is an error: the user asked for a checkpoint.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: checkpoint path does not exist; check checkpoint.load")
    if STEP_DIR.match(path.name) or path.name.endswith(".tmp"):
        if not is_complete(path):
            raise CheckpointError(f"{path}: not a complete checkpoint (no {COMPLETE} marker; it was being "
                                  "written when the run stopped); load its parent directory for the latest "
                                  "complete one")
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise CheckpointError(f"{path}: holds no complete checkpoint (step_* directory with a {COMPLETE} "
                              "marker); check checkpoint.load")
    return found


# --- reading and verifying ----------------------------------------------------------------------

def read_manifest(ckpt: str | os.PathLike) -> dict:
    """The ``COMPLETE`` record of a checkpoint: step, world_size, meta and the file table."""
    ckpt = Path(ckpt)
    if not (ckpt / COMPLETE).is_file():
        raise CheckpointError(f"{ckpt}: no {COMPLETE} marker, so this checkpoint is incomplete; "
                              "load an earlier one")
    manifest = read_json(ckpt / COMPLETE, "the completion marker")
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{ckpt / COMPLETE}: checkpoint format {manifest.get('format')!r} is not the "
                              f"supported format {FORMAT_VERSION}")
    return manifest


def verify_file(ckpt: Path, name: str, entry: dict) -> Path:
    """Check one file's size, then its sha256, against its manifest ``entry``; returns its path."""
    path = ckpt / name
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint file is missing (listed in {ckpt / COMPLETE}); "
                              "restore it or load an earlier checkpoint")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(f"{path}: {size} bytes but the checkpoint manifest records {entry['bytes']}; "
                              "the file is truncated or was modified -- restore it or load an earlier checkpoint")
    digest = file_digest(path)
    if digest != entry["sha256"]:
        raise CheckpointError(f"{path}: sha256 {digest[:16]}... does not match the manifest's "
                              f"{entry['sha256'][:16]}...; the file is corrupted -- restore it or load an "
                              "earlier checkpoint")
    return path


def verify_checkpoint(ckpt: str | os.PathLike) -> dict:
    """Verify every file of a checkpoint; returns its manifest. Reads all bytes once."""
    ckpt = Path(ckpt)
    manifest = read_manifest(ckpt)
    for name, entry in manifest["files"].items():
        verify_file(ckpt, name, entry)
    return manifest


def load_file(ckpt: str | os.PathLike, name: str, *, map_location: Any = "cpu", verify: bool = True,
              weights_only: bool = False, manifest: Optional[dict] = None) -> Any:
    """``torch.load`` one file of a complete checkpoint after checking it against the manifest.

    Pass ``manifest`` (from ``read_manifest``) when loading many files to parse ``COMPLETE`` once.
    """
    import torch

    ckpt = Path(ckpt)
    manifest = manifest if manifest is not None else read_manifest(ckpt)
    entry = manifest["files"].get(name)
    if entry is None:
        names = sorted(manifest["files"])
        held = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        raise CheckpointError(f"{ckpt}: has no file {name!r} (it holds {held})")
    path = verify_file(ckpt, name, entry) if verify else ckpt / name
    return torch.load(path, map_location=map_location, weights_only=weights_only)
