"""Turn a preemption signal into a flag the training loop polls between steps.

SLURM warns a job before killing it (``--signal=USR1@120`` sends SIGUSR1; cancellation and the end
of the time limit send SIGTERM, followed by SIGKILL after a grace period). Saving from inside a
signal handler would run arbitrary I/O and collectives at an arbitrary point of a step, so the
handler only records which signal arrived. The trainer checks ``requested`` once per step, decides
*with the other ranks* (an all-reduced flag: a signal may reach some ranks and not others), saves a
checkpoint and exits cleanly. A second signal while the flag is set is recorded the same way, so
the save is not interrupted; SIGKILL after the grace period is the only hard stop.
"""

from __future__ import annotations

import signal
import threading
from typing import Optional

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1) if hasattr(signal, "SIGUSR1") else (signal.SIGTERM,)


class PreemptionHandler:
    """Installable, uninstallable flag-setting handler for ``signals``; also a context manager."""

    def __init__(self, signals: tuple[int, ...] = DEFAULT_SIGNALS):
        self.signals = tuple(signals)
        self._received: Optional[int] = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        """Whether a preemption signal has arrived since install (or the last ``clear``)."""
        return self._received is not None

    @property
    def signal_name(self) -> Optional[str]:
        """The name of the first signal received, e.g. ``"SIGTERM"``, or None."""
        return None if self._received is None else signal.Signals(self._received).name

    def _handle(self, signum, frame) -> None:
        # Only an assignment: no I/O, no locks, nothing that could deadlock the interrupted code.
        if self._received is None:
            self._received = signum

    def install(self) -> "PreemptionHandler":
        """Route ``signals`` to the flag, remembering the handlers they replace. Main thread only."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionHandler.install() must run on the main thread (Python delivers "
                               "signals only there)")
        if self._previous:
            raise RuntimeError("PreemptionHandler is already installed")
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were in place before ``install``."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def clear(self) -> None:
        self._received = None

    def __enter__(self) -> "PreemptionHandler":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()
