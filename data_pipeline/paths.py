"""Checks on the paths a command is given, run before it reads any input. Whether a path is empty:
an unset variable in a script gives "", which ``Path`` reads as the current directory. Where an
output path can be made: a path that cannot be made is refused while nothing is lost (creating the
folders late fails with an errno that names no option). Whether an input is named twice: read
twice, its documents would count twice, in training, in a tokenizer's statistics or in a
classifier's held-out rows."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import tempfile
from contextlib import contextmanager
from typing import Callable, Hashable, Iterable, Iterator, Optional


def empty_path_problem(path: str | os.PathLike, what: str, fix: str) -> Optional[str]:
    """``"an empty path names no WHAT (it would be read as the current directory); FIX"`` when ``path`` is
    empty (``Path("")`` is ``.``: an unset variable in a script would name the current directory), else
    None. A message rather than an exception, so that each caller keeps raising the error type its own
    callers catch (a CheckpointError, a FileNotFoundError, a UserError)."""
    if os.fspath(path):
        return None
    return f"an empty path names no {what} (it would be read as the current directory); {fix}"


def nearest_existing(path: str) -> str:
    """``path`` made absolute if it exists, else its nearest existing ancestor."""
    here = os.path.abspath(path)
    while not os.path.lexists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    return here


def file_in_the_way(path: str) -> str | None:
    """The file standing where ``path``'s folder or a folder above it should be, if one does, else None."""
    here = nearest_existing(os.path.dirname(os.path.abspath(path)))
    return None if os.path.isdir(here) else here


def output_folder_problem(path: str) -> Optional[str]:
    """Why the folder that is to hold the output ``path`` cannot be made or written to, else None:
    asked before any input is read, so that no work is lost to it. It creates (and removes) a folder
    of its own, uniquely named, in the nearest folder that exists, rather than the output's folders:
    a command refused later leaves none behind, and a job beside it writing into the same new folder
    never finds it removed under it. (``os.access`` alone says yes to root on a read-only mount.)"""
    directory = os.path.dirname(os.path.abspath(path))
    existing = nearest_existing(directory)
    if os.path.islink(existing) and not os.path.exists(existing):
        return f"{existing} is a link to {os.readlink(existing)}, which does not exist"
    if not os.path.isdir(existing):
        return f"{existing} is a file, not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=existing))
    except OSError as exc:
        return f"cannot create {directory} ({exc.strerror})" if directory != existing else \
            f"{directory} is not writable ({exc.strerror})"
    return None


def make_folders(directory: str) -> list[str]:
    """Create the folders ``directory`` lacks, one level at a time, and return those this call created,
    outermost first: a folder another job creates meanwhile is not among them, so ``remove_made``
    never takes it away from under that job. A failure part-way removes what was made, then raises."""
    missing, here = [], os.path.abspath(directory)
    while not os.path.lexists(here):
        missing.append(here)
        here = os.path.dirname(here)
    made = []
    for folder in reversed(missing):
        try:
            os.mkdir(folder)
        except FileExistsError:
            continue
        except OSError:
            remove_made(made)
            raise
        made.append(folder)
    return made


def remove_made(made: list[str]) -> None:
    """Remove the folders ``make_folders`` returned, innermost first, where they are still empty (one
    holding another job's files stays, theirs too now)."""
    for folder in reversed(made):
        try:
            os.rmdir(folder)
        except OSError:
            return


@contextmanager
def made_folder(directory: str) -> Iterator[None]:
    """Make ``directory`` (and the folders above it that are missing) for the block's outputs; if the
    block fails or is stopped, the folders it made are removed again where still empty, so a refused
    or interrupted command leaves the tree as it found it."""
    made = make_folders(directory)
    try:
        yield
    except BaseException:
        remove_made(made)
        raise


def file_identity(path: str) -> Hashable:
    """One value per file however it is reached: its device and inode where it exists (a hard link is
    the same file under another name, which a resolved path does not show), else its real path."""
    try:
        st = os.stat(path)
    except OSError:
        return os.path.realpath(path)
    return st.st_dev, st.st_ino


def listed_twice(named: Iterable[tuple[str, str]], key: Callable[[str], Hashable] = file_identity) -> Optional[str]:
    """``"LABEL PATH is listed twice (also as ...)"`` for the first ``(label, path)`` naming a file that
    an earlier entry already named, however spelled (``key`` gives one value per file; links, hard or
    symbolic, are followed), else None. The earlier entry is quoted when it is written differently,
    with its label when that differs too (``--lq ./a.jsonl is listed twice (also as --hq a.jsonl)``)."""
    seen: dict[Hashable, tuple[str, str]] = {}
    for label, path in named:
        spelling = key(path)
        if spelling not in seen:
            seen[spelling] = (label, path)
            continue
        first_label, first = seen[spelling]
        also = ("" if (first_label, first) == (label, path) else f" (also as {first})" if first_label == label
                else f" (also as {first_label} {first})")
        return f"{label} {path} is listed twice{also}"
    return None


def inside_another(named: Iterable[tuple[str, str]]) -> Optional[str]:
    """``"LABEL PATH lies inside LABEL FOLDER, which reads it already"`` for the first ``(label, path)``
    below a folder another entry names (links followed), else None: a file beside the folder that
    holds it (``in`` and ``in/a.jsonl``), or a folder and one of its subfolders, would be read twice
    without being listed twice."""
    entries = [(label, path, os.path.realpath(path)) for label, path in named if os.path.lexists(path)]  # not hub names
    folders = {real: (label, path) for label, path, real in entries if os.path.isdir(real)}
    for label, path, real in entries:
        outer = _enclosing(os.path.dirname(real), folders)
        if outer is not None:
            outer_label, outer_path = folders[outer]
            return f"{label} {path} lies inside {outer_label} {outer_path}, which reads it already"
    return None


def output_inside(output: str, folders: Iterable[str]) -> Optional[str]:
    """The first of ``folders`` (existing folders among inputs; links followed) that the output file
    ``output`` would be written into, directly or below, else None: its files, and then the output
    itself, would be among that folder's files the next time it is read."""
    real = {os.path.realpath(folder): folder for folder in folders if os.path.isdir(folder)}
    found = _enclosing(os.path.realpath(os.path.dirname(os.path.abspath(output))), real)
    return None if found is None else real[found]


def _enclosing(real: str, folders) -> Optional[str]:
    """The nearest of ``folders`` (real paths) that is the real path ``real`` or holds it, else None:
    a walk up its parents, so that thousands of inputs cost one lookup each."""
    while real not in folders:
        parent = os.path.dirname(real)
        if parent == real:
            return None
        real = parent
    return real


def temp_name(path: str, suffix: str = "") -> str:
    """A name beside ``path`` to write it under before the rename that makes it appear whole. The
    process id alone is not unique: ranks on different nodes sharing a file system (each node in its
    own container) can have the same one, and would write one temporary file between them."""
    return f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}{suffix}"


def fsync_dir(path) -> None:
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


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def written_whole(path: str, suffix: str = "") -> Iterator[str]:
    """A temporary name beside ``path`` (``temp_name``) for the block to write; renamed onto ``path``
    when the block succeeds, so a reader never sees half a file, and removed when it fails (a full
    disk, a kill), so no partial file is left holding the space a retry needs. The file's bytes reach
    the disk before its rename, and the rename before the block's caller goes on: a power loss left
    a curation shard cut short under its final name, with the completion marker written after it
    intact, and the next stage read a shard missing documents, or a damaged one."""
    tmp = temp_name(path, suffix)
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path) or ".")
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def put_new(tmp: str, final: str) -> None:
    """Move the finished ``tmp`` to ``final`` in one step unless a file is there already, which raises
    FileExistsError and leaves both as they are. A hard link does this where a rename would replace
    the file (two runs writing one output, each having checked at its start that it was free); a file
    system without hard links gets the name claimed first (created exclusively, empty), then the
    rename onto the claim."""
    try:
        os.link(tmp, final)
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
            raise
        os.close(os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        try:
            os.replace(tmp, final)
        except BaseException:
            os.unlink(final)  # the empty claim, which would block the next run as an existing file
            raise
        return
    os.unlink(tmp)
