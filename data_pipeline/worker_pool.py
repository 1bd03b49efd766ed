"""The process pool the data tools run their workers in.

Workers are forked where the platform can (they start without re-importing the project) and each
ends on SIGTERM at once, as a process with no handler does. The commands turn SIGTERM into an
exception in the parent so that it can clean up (``megazero.cli``), and a forked worker inherits
that handler: a pool's ``terminate()``, which every stop and every normal end of a pool runs,
sends its workers SIGTERM and then waits for them, and a worker that caught it as an exception
could be left waiting for a task queue the parent had already locked, hanging the command for ever.
The parent alone cleans up; its workers only compute.

Resetting the handler in the worker is not enough by itself: a SIGTERM that arrives between the fork
and the reset trips the inherited handler, which Python runs only at its next check, and by then
the handler is the default, which Python does not run: the signal is lost and the worker lives on
(a CI run hung so in ``preprocess --workers 2``). So workers are forked with SIGTERM blocked, and
unblock it once they have its default action: one sent before that waits, and then ends them.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
from collections.abc import Callable, Iterator
from typing import Any, Optional

POLL_S = 1.0  # how often a wait for results looks for workers that died


class WorkerDied(OSError):
    """A worker process ended (killed by the OOM killer, or a crash in native code) with a task of its
    own unfinished: the pool replaces the worker, but the task is lost and its result never comes."""


RERUN = "run again (finished work is kept where the command resumes) with fewer workers or more memory a worker"
"""What a ``WorkerDied`` message tells the user to do, whichever executor's worker died."""


def _start_worker(initializer: Optional[Callable[..., None]], initargs: tuple) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # one sent meanwhile ends this worker now
    if initializer is not None:
        initializer(*initargs)


def worker_pool(workers: int, initializer: Optional[Callable[..., None]] = None, initargs: tuple = ()) -> Any:
    """A ``multiprocessing`` pool of ``workers`` processes (fork where available, else spawn) whose
    workers die on SIGTERM; ``initializer(*initargs)`` runs in each after that."""
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    # the workers, and the pool's thread that replaces any that die, inherit this thread's mask
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return ctx.Pool(workers, initializer=_start_worker, initargs=(initializer, initargs))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def watched(pool: Any, results: Any, what: str) -> Iterator[Any]:
    """The results of ``pool.imap`` or ``imap_unordered``, raising ``WorkerDied`` once a worker has
    ended while results are still awaited (a pool waits for a lost task's result for ever: a worker
    killed for memory hung the command with every other worker idle). ``what``: the task, as the
    error names it ("a shard's task")."""
    workers = list(pool._pool)  # every worker is started with the pool; one only ends by dying
    while True:
        try:
            yield results.next(POLL_S)
        except StopIteration:
            return
        except mp.TimeoutError:
            dead = next((w for w in workers if w.exitcode is not None), None)
            if dead is not None:
                raise WorkerDied(f"a worker process (pid {dead.pid}) {_ended(dead.exitcode)} while results of {what} "
                                 f"were awaited (a task it ran is lost); {RERUN}")


def _ended(code: int) -> str:
    if code >= 0:
        return f"exited with status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:  # a signal without a name (a real-time one)
        return f"was killed by signal {-code}"
    return f"was killed by signal {-code} ({name}{': out of memory?' if -code == signal.SIGKILL else ''})"
