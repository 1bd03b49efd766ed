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
from collections.abc import Callable
from typing import Any, Optional


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
