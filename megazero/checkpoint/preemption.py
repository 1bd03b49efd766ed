"""Turn a stop signal into a flag the training loop polls between steps.

The signals: SIGTERM (SLURM's cancellation, time limit and preemption, followed by SIGKILL after a
grace period; a Kubernetes pod deletion), SIGUSR1 (SLURM's warning, ``--signal=USR1@300``) and
SIGINT (Ctrl-C). Saving from inside a signal handler would run arbitrary I/O and collectives at an
arbitrary point of a step, so the handler only records which signal arrived. The trainer checks
``requested`` once per step, decides *with the other ranks* (an all-reduced flag: a signal may reach
some ranks and not others), saves a checkpoint and exits. A repeated SIGTERM or SIGUSR1 is recorded
the same way, so the save is not interrupted; SIGKILL after the grace period is the only hard stop.

Ctrl-C is also how a person says "now": a second SIGINT while the first one's step and save are under
way ends the process at once (status 130), after one line saying what is lost. A SIGINT within
``SAME_INTERRUPT_S`` of the first is the same interrupt delivered twice (a scheduler signals every
process of a job and the launch script passes the signal on too), not a second one.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable, Optional

DEFAULT_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGINT") if hasattr(signal, name))
SAME_INTERRUPT_S = 0.5
EXIT_INTERRUPTED = 128 + signal.SIGINT  # what a shell reports for a process ended by Ctrl-C
UNSAVED = "every step since the last complete checkpoint"


class PreemptionHandler:
    """Installable, uninstallable flag-setting handler for ``signals``; also a context manager.

    ``unsaved``, if given, says what a hard stop (the second Ctrl-C) loses, e.g. "steps 41-57 (the
    last checkpoint is step 40)"; it runs inside the signal handler, so it must only format values.
    """

    def __init__(self, signals: tuple[int, ...] = DEFAULT_SIGNALS, unsaved: Optional[Callable[[], str]] = None):
        self.signals = tuple(signals)
        self.unsaved = unsaved
        self._received: Optional[int] = None
        self._first_interrupt: Optional[float] = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        """Whether a stop signal has arrived since install (or the last ``clear``)."""
        return self._received is not None

    @property
    def signal_name(self) -> Optional[str]:
        """The name of the first signal received, e.g. ``"SIGTERM"``, or None."""
        return None if self._received is None else signal.Signals(self._received).name

    def _handle(self, signum, frame) -> None:
        # Python runs this on the main thread between bytecodes: recording is all it does, short of
        # the hard stop, which writes with os.write (no buffered-stream locks) and leaves at once.
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._first_interrupt is None:
                self._first_interrupt = now
            elif now - self._first_interrupt > SAME_INTERRUPT_S:
                self._stop_now()
        if self._received is None:
            self._received = signum

    def _stop_now(self) -> None:
        """The second Ctrl-C: no save, no clean-up that could wait on other ranks; one line per node."""
        try:
            lost = self.unsaved() if self.unsaved is not None else UNSAVED
        except Exception:  # noqa: BLE001 - the process is leaving; a broken description must not stop that
            lost = UNSAVED
        if os.environ.get("LOCAL_RANK", "0") == "0":
            os.write(2, f"megazero: second interrupt: stopping now without saving; lost: {lost}\n".encode())
        os._exit(EXIT_INTERRUPTED)

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
        self._first_interrupt = None

    def __enter__(self) -> "PreemptionHandler":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()
