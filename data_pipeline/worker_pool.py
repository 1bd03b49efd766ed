"""The process pool the data tools run their workers in.

It is built on ``concurrent.futures.ProcessPoolExecutor`` rather than ``multiprocessing.Pool``
because of how each treats a worker that dies (the OOM killer, a crash in native code). A
``Pool`` replaces the worker and waits for its task's result for ever; and an idle worker waits
for tasks holding the task queue's lock, so one killed while idle leaves that lock taken, and the
pool's ``terminate()`` then waits on it for ever too. The executor watches every worker's exit and,
at the first death, fails every awaited result and kills the other workers without touching the
queue's locks; and the wait for a result here looks at the workers too, for one killed while it
sends a result leaves the executor reading the rest of that message for ever. So a death anywhere
ends the command with one line (``WorkerDied``).

Workers are forked where the platform can (they start without re-importing the project) and end on
SIGTERM at once, as a process with no handler does. The commands turn SIGTERM into an exception in
the parent so that it can clean up (``megazero.cli``), and a forked worker inherits that handler:
a worker that caught the signal as an exception would report it as its task's error and live on,
and the pool's end, which sends its workers SIGTERM, would then wait for it for ever. The parent
alone cleans up; its workers only compute. For the same reason they ignore SIGINT: a Ctrl-C reaches
the whole process group, and the parent's stop then ends them.

Resetting the handler in the worker is not enough by itself: a SIGTERM that arrives between the fork
and the reset trips the inherited handler, which Python runs only at its next check, and by then
the handler is the default, which Python does not run: the signal is lost and the worker lives on
(a CI run hung so in ``preprocess --workers 2``). So workers are forked with SIGTERM blocked, and
unblock it once they have its default action: one sent before that waits, and then ends them.

A parent killed outright (SIGKILL, the OOM killer) runs none of this, and its workers, waiting on
their pipes to it, lived on for good, holding the locks of its temporary files (which then kept a
rerun from sweeping them). On Linux each worker asks the kernel for a SIGTERM when its parent dies.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Optional

AHEAD = 4  # tasks handed out per worker before their results are taken: enough to keep each busy
POLL_S = 1.0  # how often a wait for results looks for workers that died
DEATH_S = 10.0  # how long a broken pool's workers are given to end before the error names the first death


class WorkerDied(OSError):
    """A worker process ended (killed by the OOM killer, or a crash in native code): the tasks it and
    the others were running are lost, and the pool is stopped."""


RERUN = "run again (finished work is kept where the command resumes) with fewer workers or more memory a worker"
"""What a ``WorkerDied`` message tells the user to do, whichever executor's worker died."""


PR_SET_PDEATHSIG = 1  # prctl's request for a signal at the parent's death (linux/prctl.h)


def _start_worker(parent: int, initializer: Optional[Callable[..., None]], initargs: tuple) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _end_with(parent)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # one sent meanwhile ends this worker now
    if initializer is not None:
        initializer(*initargs)


def _end_with(parent: int) -> None:
    """Have the kernel send this worker SIGTERM when ``parent`` (the process that forked it, from its
    main thread) dies; one that died before the request is the signal's now. Elsewhere than Linux,
    nothing."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    if prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0 and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


class WorkerPool:
    """``workers`` processes (fork where available, else spawn) whose workers die on SIGTERM;
    ``initializer(*initargs)`` runs in each after that. A context manager: leaving it stops the
    workers, also while they run tasks."""

    def __init__(self, workers: int, initializer: Optional[Callable[..., None]] = None, initargs: tuple = ()):
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        self.workers = workers
        self._executor = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_start_worker,
                                             initargs=(os.getpid(), initializer, initargs))
        self._processes: dict[int, Any] = {}  # every worker started, dead ones kept: the error names them

    def imap(self, fn: Callable[[Any], Any], jobs: Iterable[Any], what: str, ordered: bool = True) -> Iterator[Any]:
        """``fn(job)`` for every job, in the jobs' order or (``ordered=False``) as they finish. At most
        ``AHEAD`` jobs a worker are taken from ``jobs`` before their results are consumed, so a long
        iterable is not read into memory. A task's exception is raised here; a worker's death raises
        ``WorkerDied``, naming its signal and ``what`` was awaited ("a shard's task")."""
        jobs = iter(jobs)
        pending: deque[Future] = deque()
        try:
            while True:
                while len(pending) < AHEAD * self.workers:
                    job = next(jobs, _END)
                    if job is _END:
                        break
                    pending.append(self._submit(fn, job))
                if not pending:
                    return
                yield self._finished(pending, ordered).result()
        except BrokenProcessPool:
            raise WorkerDied(f"{self._dead()} while results of {what} were awaited (the tasks running are lost); "
                             f"{RERUN}") from None

    def _finished(self, pending: deque[Future], ordered: bool) -> Future:
        """The first pending future (``ordered``) or any, once done, taken out of ``pending``. The workers
        are looked at meanwhile: one killed while it sent a result left the executor's own watch
        reading the rest of that message for ever, and no future ever failed."""
        while True:
            done, _ = wait([pending[0]] if ordered else pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
            if done:
                future = pending[0] if ordered else next(f for f in pending if f in done)
                pending.remove(future)
                return future
            if any(process.exitcode is not None for process in self._processes.values()):
                raise BrokenProcessPool  # as the executor fails a result when it sees the death itself

    def _submit(self, fn: Callable[[Any], Any], job: Any) -> Future:
        # a submit may fork workers (all of them at the first, with fork), which inherit this thread's mask
        before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            future = self._executor.submit(fn, job)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
        self._processes.update(self._executor._processes or {})
        return future

    def _dead(self) -> str:
        """The first death. A dead worker's pipes close a moment before its exit status can be read, and
        once the executor sees the death it sends every other worker SIGTERM: the statuses are read
        after the first can be, and a moment more."""
        deadline = time.monotonic() + DEATH_S
        while not any(p.exitcode is not None for p in self._processes.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        ended = [p for p in self._processes.values() if p.exitcode is not None]
        first = next((p for p in ended if p.exitcode != -signal.SIGTERM), ended[0] if ended else None)
        if first is None:
            return "a worker process ended"
        return f"a worker process (pid {first.pid}) {_ended(first.exitcode)}"

    def close(self) -> None:
        """Stop the workers now, running tasks and all; every result wanted has been taken by then. A
        worker ended while it sent a result leaves the executor's watch reading the rest of it; this
        process's own copy of the results pipe's sending end kept that read open for ever, so it is
        closed once no worker is left, and the read ends."""
        for process in list(self._processes.values()):
            if process.exitcode is None:
                process.terminate()
        for process in list(self._processes.values()):
            process.join()
        results = self._executor._result_queue
        if results is not None:
            results._writer.close()
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_END = object()


def _ended(code: int) -> str:
    if code >= 0:
        return f"exited with status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:  # a signal without a name (a real-time one)
        return f"was killed by signal {-code}"
    return f"was killed by signal {-code} ({name}{': out of memory?' if -code == signal.SIGKILL else ''})"
