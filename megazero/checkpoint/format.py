"""The on-disk layout of a checkpoint and everything needed to find and read one safely.

A checkpoint root holds one directory per saved step and a pointer to the newest::

    ROOT/
      latest                      text: "step_0001200"; replaced atomically, the last thing a save does
      step_0001200/
        COMPLETE                  JSON: format, step, world_size, caller's meta, every file's
                                  {rank, bytes, sha256}, and the sha256 of all that (its own checksum);
                                  written only after every rank finished
        manifest.rank00000.json   what rank 0 wrote (the same entries, per rank)
        <files named by the caller, e.g. rank_00003.safetensors>
      step_0001300.tmp/           a save in progress, or one that died: never loaded

A directory is a checkpoint only if it is named ``step_<digits>`` *and* holds ``COMPLETE``. Because
``COMPLETE`` is written inside the temporary directory before it is renamed, a crash at any moment
leaves either the old set of checkpoints or the old set plus a complete new one -- never a partial
checkpoint under a final name. Loading re-checks ``COMPLETE`` against its own checksum and every
file's size and sha256 against ``COMPLETE``. A ``latest`` that cannot be read is ignored with a
warning: the newest complete directory is found by scanning.

Every file is a safetensors file holding tensors and JSON values (``serialization``): loading one
never unpickles, so it runs no code whoever wrote it. The checksums catch damage, not forgery
(whoever writes the files can write ``COMPLETE``); safety comes from the format. Format 1 stored
``torch.save`` pickles and is refused.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple, Optional

from data_pipeline.paths import empty_path_problem, fsync_dir

from megazero.checkpoint import serialization
from megazero.errors import UserError

FORMAT_VERSION = 2
COMPLETE = "COMPLETE"
CHECKSUM = "sha256"  # COMPLETE's checksum of its own content
LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d+)$")
CHUNK = 1 << 20


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete or damaged, or cannot be written; the message names the path."""


NOT_WRITABLE = "make the directory writable or set checkpoint.save_dir to another one"
OS_ERROR_WORDS = {
    errno.ENOSPC: "no space left on device: free space, or lower checkpoint.keep_last where older checkpoints take it",
    errno.EDQUOT: "disk quota exceeded: free space in the quota, or lower checkpoint.keep_last where older "
                  "checkpoints take it",
    errno.EROFS: "read-only file system: set checkpoint.save_dir to a writable directory",
    errno.EACCES: f"permission denied: {NOT_WRITABLE}",
    errno.EPERM: f"operation not permitted: {NOT_WRITABLE}",
    errno.ENOTDIR: "a part of the path is a file, not a directory: set checkpoint.save_dir to a directory",
    errno.EEXIST: "the path exists and is not a directory: set checkpoint.save_dir to a directory",
    errno.EIO: "input/output error: the storage failed; check it before saving again",
}


def os_error_words(e: OSError) -> str:
    """Why a file operation failed, and the fix, in words (``unexpected pos 5056 vs 5008`` helps nobody)."""
    return OS_ERROR_WORDS.get(e.errno) or e.strerror or str(e)


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def rank_manifest_name(rank: int) -> str:
    return f"manifest.rank{rank:05d}.json"


_ZEROS = memoryview(bytes(1 << 22))


class HashingWriter:
    """A write-only file wrapper that hashes and counts the bytes as ``torch.save`` streams them,
    so a checksum costs no second read of a multi-gigabyte shard."""

    def __init__(self, f):
        self.f, self.sha256, self.bytes = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.bytes += len(data)
        return self.f.write(data)

    def skip_zeros(self, nbytes: int) -> None:
        """``nbytes`` zero bytes, hashed and counted but left as a hole in the file (a seekable file:
        the filesystem stores no blocks for them, and reads them back as zeros). The file's end must
        be set by ``truncate`` when it finishes with a hole."""
        while nbytes > 0:
            n = min(nbytes, len(_ZEROS))
            self.sha256.update(_ZEROS[:n])
            self.bytes += n
            self.f.seek(n, os.SEEK_CUR)
            nbytes -= n

    def flush(self) -> None:
        self.f.flush()


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary sibling, fsync it, then rename it over ``path``; on failure the
    sibling is removed and ``path`` keeps its old content."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def content_digest(record: dict) -> str:
    """sha256 of a record's canonical JSON (sorted keys, no spaces), its own checksum field left out."""
    body = {key: value for key, value in record.items() if key != CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def complete_text(record: dict) -> str:
    """The text of a ``COMPLETE`` marker: ``record`` with its own checksum added."""
    return json.dumps({**record, CHECKSUM: content_digest(record)}, indent=1)


def read_json(path: Path, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {what} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({e}); the file is damaged") from None
    except RecursionError:  # nested deeper than any record this version writes
        raise CheckpointError(f"{path}: {what} is nested too deeply to be a checkpoint's record; the file is "
                              "damaged") from None


def file_digest(f: BinaryIO) -> str:
    """sha256 of an open file's bytes from its start, streamed (``f`` is left at its end)."""
    sha = hashlib.sha256()
    f.seek(0)
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


def latest_checkpoint(root: str | os.PathLike, none_left: str = "move it out of the way to train from step 0") \
        -> Optional[Path]:
    """The complete checkpoint with the highest step under ``root`` (None if there is none).

    A save's commit is the rename of its complete ``step_N.tmp``; ``ROOT/latest`` is replaced after
    it, so the two disagree only where a save was cut between them (or the pointer was edited):
    then the newest checkpoint still wins, with a warning, since resuming from the older one would
    retrain its steps and save over the newer. A pointer that is damaged or names a directory since
    deleted is warned about too. A ``step_N`` directory without its ``COMPLETE`` record, newer than
    the checkpoint chosen, is an error (raised before any warning, so it is the one line printed): a
    save writes ``COMPLETE`` before it renames ``step_N.tmp``, and retention renames a checkpoint
    before deleting it, so such a directory was copied or edited by hand, and the run would later
    save over it. ``none_left`` is the way forward that error offers where no complete checkpoint
    is left: a training run can start afresh, an explicit load cannot.
    """
    root = Path(root)
    found = list_checkpoints(root)
    chosen = found[-1][1] if found else None
    step = int(STEP_DIR.match(chosen.name).group(1)) if chosen is not None else -1
    damaged = sorted(p for p in root.glob("step_*") if STEP_DIR.match(p.name) and p.is_dir()
                     and not is_complete(p) and int(STEP_DIR.match(p.name).group(1)) > step) if root.is_dir() else []
    if damaged:
        instead = f"move it out of the way to use {chosen.name}" if chosen is not None else none_left
        raise CheckpointError(f"{damaged[-1]}: a checkpoint directory without its {COMPLETE} record, newer than "
                              f"the newest complete checkpoint in {root}; restore it, or {instead}")
    named = read_pointer(root)
    if named is not None and named != chosen:
        state = "is not a complete checkpoint" if not is_complete(named) else "is older"
        _warn_once(f"megazero: warning: {root / LATEST} names {named.name}, which {state}; using "
                   f"{chosen.name if chosen is not None else 'none'}, the newest complete checkpoint in {root} (to "
                   "go back to an older one, move the newer ones out of it)")
    return chosen


def read_pointer(root: Path) -> Optional[Path]:
    """The directory ``ROOT/latest`` names; None if there is no pointer, or (with a warning on stderr,
    where ``generate``'s text does not go) if it cannot be read or holds something other than a
    ``step_<digits>`` name."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        reason = str(e)
    else:
        if STEP_DIR.fullmatch(name):
            return root / name
        reason = f"it holds {name[:40]!r}, not a step_<digits> directory name"
    _warn_once(f"megazero: warning: {pointer}: damaged checkpoint pointer ({reason}); using the newest complete "
               f"checkpoint found in {root} instead")
    return None


@functools.cache
def _warn_once(message: str) -> None:
    """On stderr, once a process: the checks before a run and the run itself look the pointer up."""
    print(message, file=sys.stderr, flush=True)


def earlier_instead(ckpt: Path, where: str) -> str:
    """What to add to a refusal of ``ckpt``, found in ``where``: a run resumes its own newest
    checkpoint whatever ``checkpoint.load`` says, so going back to an earlier one means moving this
    one out of ``save_dir``."""
    if where != "checkpoint.save_dir":
        return ""
    return f" (to resume from the checkpoint before it instead, move {ckpt} out of {ckpt.parent})"


def start_checkpoint(load: Optional[str], save_dir: str | os.PathLike) -> tuple[Optional[Path], str]:
    """(the checkpoint a training run starts from, or None; the setting that names it).

    The run's own progress in ``save_dir`` comes first, so a relaunch of the same command (a requeued
    job) continues where the last launch stopped; ``load`` is where a run starts while ``save_dir``
    holds no checkpoint (if it always won, every relaunch would start over from it, and a ``load``
    since deleted would stop the relaunch). Rolling back within ``save_dir`` is moving its newer
    checkpoints out of it: a ``load`` that won there would roll back again at every relaunch, while
    retention deleted the new checkpoints and kept the old, newer-numbered ones. An error names the
    setting it comes from."""
    fresh = "move it out of the way to train from step 0" if load is None else \
        f"move it out of the way to start from checkpoint.load {load}"
    try:
        own = latest_checkpoint(save_dir, none_left=fresh)
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint.save_dir: {exc}") from None
    if own is not None or load is None:
        return own, "checkpoint.save_dir"
    try:
        return resolve_checkpoint(load), "checkpoint.load"
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint.load: {exc}") from None


def resolve_checkpoint(path: str | os.PathLike, source: str = "checkpoint.load") -> Path:
    """The checkpoint an explicit load names: ``path`` itself if it is a complete checkpoint
    directory, else the latest complete one under it. ``source`` is what the user set to name it
    (``checkpoint.load``, a command's argument), for the error messages.

    Unlike ``latest_checkpoint`` (for the implicit resume from ``save_dir``, where finding nothing
    means a fresh start), finding nothing here is an error: the user asked for a checkpoint.
    """
    empty = empty_path_problem(path, "checkpoint", f"check {source}")
    if empty:
        raise CheckpointError(empty)
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: checkpoint path does not exist; check {source}")
    if not STEP_DIR.match(path.name) and STEP_DIR.match(path.resolve().name):  # ".", or a link named "best"
        path = path.resolve()
    if (path.is_dir() and not STEP_DIR.match(path.name) and not path.name.endswith(".tmp")
            and (path / COMPLETE).is_file()):
        raise CheckpointError(f"{path}: holds a checkpoint under a name other than step_NNNNNNN, the name megazero "
                              f"finds checkpoints by; rename it, or link it under that name, and give that as {source}")
    if STEP_DIR.match(path.name) or path.name.endswith(".tmp"):
        if path.name.endswith(".tmp") and (path / COMPLETE).is_file():  # cut between the record and the rename
            raise CheckpointError(f"{path}: a save stopped after writing its {COMPLETE} record, before renaming "
                                  f"the directory into place; rename it {path.name[:-len('.tmp')]} to load it, or "
                                  "load its parent directory for the latest complete one")
        if not is_complete(path):
            raise CheckpointError(f"{path}: not a complete checkpoint (no {COMPLETE} marker; it was being "
                                  "written when the run stopped); load its parent directory for the latest "
                                  "complete one")
        return path
    if path.is_file():  # a file of a checkpoint (its COMPLETE, a rank's tensors), or some other file
        fix = (f"the checkpoint holding it ({path.parent})" if STEP_DIR.match(path.parent.name)
               else "a step_* checkpoint directory, or the folder holding them,")
        raise CheckpointError(f"{path}: is a file, not a checkpoint directory; give {fix} as {source}")
    found = latest_checkpoint(path, none_left=f"give another checkpoint as {source}")
    if found is None:
        if list_checkpoints(path / "checkpoints"):  # RUN_DIR, where checkpoint.save_dir is RUN_DIR/checkpoints
            raise CheckpointError(f"{path}: holds no complete checkpoint, but {path / 'checkpoints'} does (a run "
                                  f"directory keeps its checkpoints there); give that as {source}")
        raise CheckpointError(f"{path}: holds no complete checkpoint (step_* directory with a {COMPLETE} "
                              f"marker); check {source}")
    return found


# --- reading and verifying ----------------------------------------------------------------------

def read_manifest(ckpt: str | os.PathLike) -> dict:
    """The ``COMPLETE`` record of a checkpoint (step, world_size, meta and the file table), after
    checking its format and its own checksum: one changed digit of the samples consumed would
    otherwise resume on shifted data."""
    ckpt = Path(ckpt)
    path = ckpt / COMPLETE
    if not path.is_file():
        raise CheckpointError(f"{ckpt}: no {COMPLETE} marker, so this checkpoint is incomplete; "
                              "load an earlier one")
    manifest = read_json(path, "the completion marker")
    version = manifest.get("format") if isinstance(manifest, dict) else None
    if version == 1:
        raise CheckpointError(f"{path}: checkpoint format 1 stores pickled Python objects, which can run code "
                              f"when loaded, so it is not read; resume from a format-{FORMAT_VERSION} checkpoint, "
                              "or load this one with the megazero release that wrote it if you trust its source")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {version!r} is not the supported format {FORMAT_VERSION}")
    if manifest.get(CHECKSUM) != content_digest(manifest):
        raise CheckpointError(f"{path}: its content does not match its own sha256 (a value in it was changed "
                              "or damaged); load an earlier checkpoint")
    problem = _record_problem(manifest)
    if problem:  # a record resealed by hand, or written by a tool that got the format wrong
        raise CheckpointError(f"{path}: {problem}; this is not a record megazero writes: load an earlier checkpoint")
    named = STEP_DIR.match(ckpt.name)
    if named and int(named.group(1)) != manifest["step"]:  # checkpoints are found, ordered and pruned by name
        raise CheckpointError(f"{ckpt}: its {COMPLETE} records step {manifest['step']}, not the step its name says "
                              f"(a checkpoint copied under another name?); name it step_{manifest['step']:07d}, or "
                              "move it out of the way")
    return manifest


def _record_problem(manifest: dict) -> Optional[str]:
    """What in a ``COMPLETE`` record's structure the readers could not use, or None."""
    def whole(value, low: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= low

    if not whole(manifest.get("step"), 0) or not whole(manifest.get("world_size"), 1):
        return f"step {manifest.get('step')!r} and world_size {manifest.get('world_size')!r} must be whole numbers"
    if not isinstance(manifest.get("meta"), dict) or not isinstance(manifest.get("files"), dict):
        return "meta and files must be JSON objects"
    for name, entry in manifest["files"].items():
        if not (isinstance(entry, dict) and whole(entry.get("rank"), 0) and whole(entry.get("bytes"), 0)
                and isinstance(entry.get("sha256"), str)):
            return f"file {name!r} must have a rank, a size in bytes and a sha256, got {entry!r}"
    return None


class FileIdentity(NamedTuple):
    """Which file an open descriptor reads, and which version of it: a file replaced at its path (a
    re-save of the step swapping its directory, retention deleting it and a later save reusing the
    name) is another inode, and one rewritten in place has another modification time."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, f: BinaryIO) -> "FileIdentity":
        st = os.fstat(f.fileno())
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def open_checked(ckpt: Path, name: str, entry: dict, checked: dict[str, FileIdentity],
                 sha256: bool = True) -> BinaryIO:
    """One file of a checkpoint, opened once and checked through the descriptor returned, so that
    what the caller reads from it is what was checked: a check by path followed by a read that opens
    the path again could meet two different files.

    The size is checked against the manifest ``entry``, then (unless ``sha256`` is False) the sha256,
    and the file's identity is recorded in ``checked`` under ``name``. A file already in ``checked``
    (hashed earlier, e.g. by a load's plan) is not hashed again: it must still be that very file.
    """
    path = ckpt / name
    try:
        f = open(path, "rb")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise CheckpointError(f"{path}: checkpoint file is missing (listed in {ckpt / COMPLETE}); "
                              "restore it or load an earlier checkpoint") from None
    except OSError as e:
        raise CheckpointError(f"{path}: checkpoint file cannot be read: {e.strerror or e}") from None
    try:
        identity = FileIdentity.of(f)
        if name in checked:
            confirm_unchanged(f, path, checked[name])
        else:
            _check_content(f, path, entry, identity.size, sha256)
            if sha256:
                checked[name] = identity
        f.seek(0)
    except BaseException:
        f.close()
        raise
    return f


def _check_content(f: BinaryIO, path: Path, entry: dict, size: int, sha256: bool) -> None:
    """The open file's ``size``, then (with ``sha256``) its digest, against its manifest ``entry``."""
    if size != entry["bytes"]:
        raise CheckpointError(f"{path}: {size} bytes but the checkpoint manifest records {entry['bytes']}; "
                              "the file is truncated or was modified -- restore it or load an earlier checkpoint")
    if not sha256:
        return
    digest = file_digest(f)
    if digest != entry["sha256"]:
        raise CheckpointError(f"{path}: sha256 {digest[:16]}... does not match the manifest's "
                              f"{entry['sha256'][:16]}...; the file is corrupted -- restore it or load an "
                              "earlier checkpoint")


def confirm_unchanged(f: BinaryIO, path: Path, expected: Optional[FileIdentity]) -> None:
    """The open file ``f`` must be the file whose sha256 was checked as ``expected`` (None: nothing was
    checked), unchanged: called on opening a file checked before, and again after reading, since a
    write in place lands in the bytes read through any descriptor."""
    if expected is not None and FileIdentity.of(f) != expected:
        raise CheckpointError(f"{path}: the checkpoint changed while it was read (this file was replaced or "
                              "rewritten after its sha256 was checked); load it again once nothing writes "
                              "to it, or load an earlier checkpoint")


def verify_file(ckpt: Path, name: str, entry: dict, sha256: bool = True,
                checked: Optional[dict[str, FileIdentity]] = None) -> None:
    """Check one file's size, then (unless ``sha256`` is False) its sha256, against its manifest
    ``entry``; ``checked`` as for ``open_checked``, which records the file there."""
    with open_checked(ckpt, name, entry, {} if checked is None else checked, sha256):
        pass


def verify_checkpoint(ckpt: str | os.PathLike) -> dict:
    """Verify every file of a checkpoint; returns its manifest. Reads all bytes once."""
    ckpt = Path(ckpt)
    manifest = read_manifest(ckpt)
    for name, entry in manifest["files"].items():
        verify_file(ckpt, name, entry)
    return manifest


def load_file(ckpt: str | os.PathLike, name: str, *, verify: bool = True, manifest: Optional[dict] = None,
              checked: Optional[dict[str, FileIdentity]] = None) -> Any:
    """One file of a complete checkpoint, checked against the manifest, with its tensors on the CPU;
    checked and parsed through one descriptor (``open_checked``, whose ``checked`` this is).

    Reading runs no code from the file (see ``serialization``). Pass ``manifest`` (from
    ``read_manifest``) when loading many files to parse ``COMPLETE`` once.
    """
    ckpt = Path(ckpt)
    manifest = manifest if manifest is not None else read_manifest(ckpt)
    entry = manifest["files"].get(name)
    if entry is None:
        names = sorted(manifest["files"])
        held = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        raise CheckpointError(f"{ckpt}: has no file {name!r} (it holds {held})")
    path, checked = ckpt / name, {} if checked is None else checked
    with open_checked(ckpt, name, entry, checked, sha256=verify) as f:
        try:
            tree = serialization.read(f)
        except serialization.FileFormatError as e:
            confirm_unchanged(f, path, checked.get(name))  # a file rewritten under the read is not damaged
            raise CheckpointError(f"{path}: {e}; the file is damaged or was not written by megazero -- restore "
                                  "it or load an earlier checkpoint") from None
        confirm_unchanged(f, path, checked.get(name))
    return tree


# --- before the first step ----------------------------------------------------------------------

def probe_writable(directory: str | os.PathLike, need_bytes: int) -> None:
    """Fail now, not at the first save hours into a run, if checkpoints cannot be written to
    ``directory``: create it, write, fsync and remove a small file, and compare its free space
    with ``need_bytes`` (the caller's estimate of one checkpoint). A folder where each save puts its
    pointer to the newest checkpoint (``latest``) would fail every save: the rename cannot replace it."""
    directory = Path(directory)
    pointer = directory / LATEST
    if pointer.is_dir() and not pointer.is_symlink():
        raise CheckpointError(f"{pointer}: is a folder, where every save writes its pointer to the newest checkpoint "
                              f"(a file); move it out of {directory}")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=directory)
        try:
            os.write(fd, b"megazero write probe\n")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise CheckpointError(f"{directory}: checkpoints cannot be written here: {os_error_words(e)}") from None
    free = shutil.disk_usage(directory).free
    if free < need_bytes:
        raise CheckpointError(f"{directory}: {_size(free)} free, a checkpoint needs about {_size(need_bytes)}; "
                              "free space or set checkpoint.save_dir to a larger file system")


def _size(nbytes: float) -> str:
    """Bytes in GiB, or in MiB or KiB where GiB would round a small model's checkpoint to 0.0."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{int(nbytes)} B"
