"""One job per run directory: an exclusive lock file that names its holder.

Two jobs given the same ``run_dir`` would otherwise share it silently: the second adopts the first's
live checkpoint, rewrites its ``metrics.jsonl`` and races it on every save. Rank 0 of a job takes
``RUN_DIR/LOCK`` before it writes anything there and keeps it for the job's life, and likewise
``SAVE_DIR/LOCK``: two jobs with their own run directories but one ``checkpoint.save_dir`` would
race the same way on their checkpoints.

The lock is a file created with ``O_EXCL`` (atomic on local filesystems and NFS), holding the
holder's host, pid and start time. A holder that died without cleaning up (``kill -9``, a lost node)
must not block its own resume, so a lock is *stale* when its process is gone (same host and pid
namespace: its pid is not running, or runs another process, started since a reboot handed pids out
again), or when its holder stopped refreshing it:
the holder touches the file every ``HEARTBEAT_S`` seconds, and one untouched for ``STALE_AFTER_S``
is taken over (the only test possible across hosts and pid namespaces, or where the holder's
process cannot be told from another). A stale lock is replaced by an atomic rename, then
read back: of two jobs taking over at once, the one whose record is in the file wins and the other
fails with the usual message.

The record also names the holder's job by its rendezvous address (``job_identity``), which every
rank of one job shares and no two live jobs can: the first rank of another node, checking the
directories before it trains, can then tell its own job's fresh lock from another job's.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from megazero.errors import UserError

LOCK_FILE = "LOCK"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 600.0


class RunDirBusy(UserError):
    """Another live job holds the run directory."""


def job_identity(env=os.environ) -> Optional[str]:
    """The launch's rendezvous address (``MASTER_ADDR:MASTER_PORT``, with torchrun's run id), the same
    on every rank of a job and bound by one live job at a time; None for a launch without one."""
    if not env.get("MASTER_ADDR") or not env.get("MASTER_PORT"):
        return None
    return f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}/{env.get('TORCHELASTIC_RUN_ID', '')}"


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs. A killed process whose parent died too stays a
    zombie until init reaps it, which can take seconds; a signal reaches a zombie all the same, so its
    state is read where ``/proc`` gives it: a job relaunched at once after ``kill -9`` found its own
    dead rank 0 "alive" and refused to resume."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        pass
    fields = _stat_fields(pid)
    return fields is None or fields[0] not in ("Z", "X")  # no /proc (not Linux), or gone since: trust the signal


def _stat_fields(pid: int) -> Optional[list[str]]:
    """The fields of ``/proc/PID/stat`` after the process's name (the state is the first, the start time
    the twentieth), or None where they cannot be read. The name, in parentheses, may hold spaces and
    parentheses itself, so the fields are split after its last closing one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields if len(fields) >= 20 else None


def _process_identity(pid: int) -> Optional[str]:
    """What tells process ``pid`` from a later one given the same pid: this boot's id and the process's
    start time in clock ticks since boot (``/proc``); None where they cannot be read (not Linux, or the
    process gone)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return None
    fields = _stat_fields(pid)
    return None if fields is None else f"{boot}:{fields[19]}"  # field 22 of the file, starttime


def _pid_namespace() -> Optional[str]:
    """This process's pid namespace (``/proc/self/ns/pid``), or None where it cannot be read: two
    containers of one host name (host networking) number their processes apart."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


class RunDirLock:
    """Held from ``acquire`` to ``release`` (or the process's end); a context manager too."""

    def __init__(self, run_dir: str | os.PathLike, *, field: str = "logging.run_dir", what: str = "run directory",
                 heartbeat_s: float = HEARTBEAT_S, stale_after_s: float = STALE_AFTER_S):
        self.path = Path(run_dir) / LOCK_FILE
        self.field, self.what = field, what  # the setting that names the directory, and what it is
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                       "pid_ns": _pid_namespace(), "process": _process_identity(os.getpid()), "job": job_identity()}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def holder(self) -> Optional[dict]:
        """The record in the lock file, or None when there is none, it is unreadable, or it is not a
        record this module writes: a file left by another tool, or edited by hand, names no process
        to look for (a pid of -1 would signal every process this user may signal), so it is in use
        until its heartbeat stops, as an unreadable one is."""
        try:
            record = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return record if _is_record(record) else None

    def is_stale(self, holder: Optional[dict]) -> bool:
        """Whether the lock's holder is gone. Its process is looked for only where this job sees the
        holder's pids (same host and pid namespace); where the pid runs, it must be the holder's own
        process (boot and start time), and where that cannot be told (a record of an older version, no
        ``/proc``), or the pids are not this job's to see, the heartbeat decides."""
        same_pids = holder is not None and holder.get("host") == self.record["host"] and (
            holder.get("pid_ns") in (None, self.record["pid_ns"]))
        if same_pids and not _pid_alive(holder["pid"]):
            return True
        then, now = (holder.get("process"), _process_identity(holder["pid"])) if same_pids else (None, None)
        if then is not None and now is not None:
            return now != then
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return True
        return age > self.stale_after_s

    def busy(self, own_job: Optional[str] = None) -> Optional[str]:
        """Why another job holds this lock now (a live holder's), or None; takes nothing. A launch asks
        before its other checks: the directory of a live job holds that job's checkpoints and config,
        which another launch's checks would misread as its own. A lock of ``own_job`` (a rank's own
        job, whose rank 0 may have taken it already) is not busy."""
        if not self.path.exists():
            return None
        holder = self.holder()
        if own_job is not None and holder is not None and holder.get("job") == own_job:
            return None
        return None if self.is_stale(holder) else self._busy_message(holder)

    def acquire(self) -> "RunDirLock":
        text = json.dumps(self.record)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            fd = None
        except OSError as exc:
            raise self._unwritable(exc) from None
        if fd is None:
            self._take_over(text)
        else:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
        self._thread = threading.Thread(target=self._beat, name="run-dir-lock", daemon=True)
        self._thread.start()
        return self

    def _take_over(self, text: str) -> None:
        """Replace a stale lock with this job's record, or raise ``RunDirBusy`` where it is not stale or
        another job's takeover landed last. Its writes fail as creating the lock does, with one line
        (they raised a traceback where the directory had become unwritable since the lock was left)."""
        holder = self.holder()
        if not self.is_stale(holder):
            raise RunDirBusy(self._busy_message(holder))
        tmp = self.path.with_name(f"{LOCK_FILE}.{self.record['host']}.{os.getpid()}")
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):  # written, then not renamed: leave no stray record behind
                tmp.unlink()
            raise self._unwritable(exc) from None
        if self.holder() != self.record:
            raise RunDirBusy(self._busy_message(self.holder()))
        print(f"megazero: {self.path}: took over a stale lock of {_describe(holder)}", flush=True)

    def _unwritable(self, exc: OSError) -> UserError:
        return UserError(f"{self.path.parent}: cannot write the {self.what} ({exc.strerror}); set {self.field} to a "
                         "directory this user can write")

    def _busy_message(self, holder: Optional[dict]) -> str:
        return (f"{self.path.parent}: {self.what} is in use by {_describe(holder)}; give this job another "
                f"{self.field}, or stop that job first (a lock left by a dead job on another host, or in another "
                f"container of this one, is taken over after {self.stale_after_s / 60:g} minutes; delete {self.path} "
                "if you are sure it is gone)")

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if self.holder() == self.record:
                try:
                    self.path.unlink(missing_ok=True)
                except OSError as exc:  # a folder turned read-only: the run's own error, not this, is the news
                    print(f"megazero: warning: could not remove the run lock {self.path} ({exc.strerror}); the next "
                          "launch takes it over, as its holder has ended", file=sys.stderr, flush=True)

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def run_locks(run_dir: str, save_dir: str) -> list[RunDirLock]:
    """A run's locks: its run directory's, and its checkpoint directory's unless that is the same one
    (jobs of two run directories may name one ``save_dir``). "The same" is asked of the filesystem
    where both exist: two spellings of one directory (a symlink, a bind mount, a case-insensitive
    volume) would otherwise have the job refused by its own lock."""
    same = (os.path.isdir(save_dir) and os.path.isdir(run_dir) and os.path.samefile(save_dir, run_dir)
            or os.path.abspath(save_dir) == os.path.abspath(run_dir))
    locks = [RunDirLock(run_dir)]
    return locks if same else locks + [RunDirLock(save_dir, field="checkpoint.save_dir", what="checkpoint directory")]


def _is_record(record) -> bool:
    """Whether ``record`` is a holder's record as ``RunDirLock`` writes it: a host, a process id that
    names one process (0 and negative ids name groups of them; a C int holds every pid), and a start
    time the clock can give."""
    if not isinstance(record, dict):
        return False
    pid = record.get("pid")
    return (isinstance(record.get("host"), str) and type(pid) is int and 0 < pid < 2**31
            and _since(record.get("started")) is not None
            and all(isinstance(record.get(key), (str, type(None))) for key in ("pid_ns", "process", "job")))


def _since(started) -> Optional[str]:
    """A holder's start time as a local date and time, or None where ``started`` is no such time."""
    if type(started) not in (int, float):
        return None
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
    except (OverflowError, OSError, ValueError):
        return None


def _describe(holder: Optional[dict]) -> str:
    if holder is None:
        return "another job (its lock file is unreadable)"
    return f"pid {holder['pid']} on host {holder['host']} (since {_since(holder['started'])})"
