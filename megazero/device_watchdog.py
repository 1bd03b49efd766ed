"""A deadline on the host's waits for its device, for the collectives no process group can time out.

NCCL's watchdog fails a collective that runs past ``train.collective_timeout_s`` only when the
collective was launched as such. Blocks replayed as CUDA graphs (``train.cuda_graphs``) carry theirs
inside the graph: a peer that never arrives leaves every other rank's device waiting for ever, and
its host with it, blocked on the step's results (the peer-memory barriers give up by themselves,
at twice the timeout, after this deadline). This watchdog gives those waits a deadline a little past
NCCL's (``MARGIN``), so that NCCL, whose message names the operation and its group, reports first
where it can. A thread checks the wait in progress; past the deadline it prints one line naming the
rank and what it waited for, and ends the process at once, as NCCL's watchdog does: the host thread
is blocked in the CUDA driver, so nothing can be raised in it, and a device that never finishes its
step has nothing left to save. Nothing else runs on the way out: an open profiling window and the
TensorBoard and wandb writers are not flushed (the metrics file is, line by line). The launcher
(torchrun, SLURM) then stops the other ranks.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable, Iterator, Optional

EXIT_STATUS = 3
"""The status a rank ends with when a wait passed its deadline (2 is a user error's)."""

MARGIN = 1.05
"""The deadline over the timeout it is given (the message says 5%): NCCL's watchdog, at the timeout,
names more."""


class DeviceWatchdog:
    """Ends the process when a wait inside ``waiting`` lasts over ``timeout_s`` seconds times
    ``MARGIN`` (None: no deadline, for a CPU run, whose steps compute on the host while they queue
    and whose gloo collectives time out by themselves).

    ``describe`` is called as the deadline passes and returns what the message adds after the wait
    (what stopping now loses, say). ``exit`` is ``os._exit`` in a run; a test may pass its own."""

    def __init__(self, timeout_s: Optional[float], rank: int, describe: Callable[[], str] = lambda: "",
                 exit: Callable[[int], None] = os._exit):
        self.rank, self.describe, self.exit = rank, describe, exit
        self.deadline_s = None if timeout_s is None else timeout_s * MARGIN
        self._wait: Optional[tuple[float, str]] = None  # (deadline, what is waited for)
        self._changed = threading.Condition()
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """The wait on the device inside this block has the deadline; ``what`` names it in the message
        ("step 12's results")."""
        if self.deadline_s is None:
            yield
            return
        with self._changed:
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="device-watchdog", daemon=True)
                self._thread.start()
            self._wait = (time.monotonic() + self.deadline_s, what)
            self._changed.notify()
        try:
            yield
        finally:
            with self._changed:
                self._wait = None

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()
        if self._thread is not None:
            self._thread.join()
        self._thread, self._closed = None, False  # a later wait starts a new thread

    def __enter__(self) -> "DeviceWatchdog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _watch(self) -> None:
        with self._changed:
            while not self._closed:
                if self._wait is None:
                    self._changed.wait()
                    continue
                deadline, what = self._wait
                left = deadline - time.monotonic()
                if left > 0:
                    self._changed.wait(left)
                    continue
                try:
                    extra = self.describe()
                except Exception as exc:  # noqa: BLE001 - the rank must still end, and say why
                    extra = f"(what stopping loses is unknown: {exc})"
                sys.stderr.write(f"megazero: rank {self.rank} waited {self.deadline_s:g} s for {what} on its device "
                                 f"(train.collective_timeout_s, and 5%): a collective, or a peer rank, is stuck; "
                                 f"stopping this rank{'; ' + extra if extra else ''}\n")
                sys.stderr.flush()
                self.exit(EXIT_STATUS)
                return
