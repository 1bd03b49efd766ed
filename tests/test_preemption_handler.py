"""The preemption handler on its own: a real signal sets the flag a polling loop reads, the first
signal names the stop, handlers are put back when it is taken off, only the main thread installs
it; a second Ctrl-C during the save stops at once, saying what is lost, and the same Ctrl-C
delivered twice is one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from megazero.checkpoint import PreemptionHandler
from megazero.checkpoint.preemption import UNSAVED

REPO = Path(__file__).resolve().parents[1]

POLLING_TRAINER = textwrap.dedent("""
    import time
    from megazero.checkpoint import PreemptionHandler

    with PreemptionHandler() as preemption:
        print("READY", flush=True)
        deadline = time.monotonic() + 60
        while not preemption.requested and time.monotonic() < deadline:
            time.sleep(0.01)  # one "training step"
        print("SAVING AFTER", preemption.signal_name, flush=True)
""")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_to_a_process_sets_the_flag_and_it_exits_cleanly(signum):
    proc = subprocess.Popen([sys.executable, "-c", POLLING_TRAINER], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "READY"
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out.strip() == f"SAVING AFTER {signal.Signals(signum).name}"


def test_install_and_uninstall_restore_previous_handlers():
    """The stop is reported by its first signal (SLURM's warning, not the SIGTERM after it), and a
    handler taken off can be put back. (Planted: the last signal reported; ``uninstall`` keeping the
    replaced handlers, so a second ``install`` said it was already installed.)"""
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        handler = PreemptionHandler().install()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert handler.requested and handler.signal_name == "SIGUSR1" and seen == []
        handler.uninstall()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]
        handler.clear()
        assert not handler.requested
        handler.install().uninstall()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_install_off_the_main_thread_is_refused():
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_try_install()))
    thread.start()
    thread.join()
    assert "main thread" in errors[0]


def _try_install() -> str:
    try:
        PreemptionHandler().install()
    except RuntimeError as e:
        return str(e)
    return "installed"


SLOW_SAVE = textwrap.dedent("""
    import sys, time
    from megazero.checkpoint import PreemptionHandler

    unsaved = (lambda: "steps 41-57 (the last checkpoint is step 40)") if sys.argv[1] == "described" else None
    with PreemptionHandler(unsaved=unsaved) as preemption:
        print("READY", flush=True)
        while not preemption.requested:
            time.sleep(0.01)  # training steps
        print("SAVING AFTER", preemption.signal_name, flush=True)
        time.sleep(float(sys.argv[2]))  # a save that takes a while
    print("SAVED", flush=True)
""")


def _slow_saver(described: bool, save_s: float) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SAVE, "described" if described else "plain", str(save_s)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "READY"
    return proc


@pytest.mark.parametrize("described", [True, False])
def test_second_ctrl_c_during_the_save_stops_at_once_saying_what_is_lost(described):
    proc = _slow_saver(described, save_s=60)
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().strip() == "SAVING AFTER SIGINT"
    time.sleep(1.0)  # a person's second Ctrl-C, not the first one delivered twice
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 130 and "SAVED" not in out
    lost = "steps 41-57 (the last checkpoint is step 40)" if described else UNSAVED
    assert err.strip() == f"megazero: second interrupt: stopping now without saving; lost: {lost}", err


def test_one_ctrl_c_delivered_twice_is_not_a_second_one(monkeypatch):
    from megazero.checkpoint import preemption as module

    now = [100.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: now[0])
    handler = module.PreemptionHandler()
    stops = []
    monkeypatch.setattr(handler, "_stop_now", lambda: stops.append(now[0]))
    handler._handle(signal.SIGINT, None)
    now[0] += 0.05  # the copy the launch script passed on, just after the scheduler's own
    handler._handle(signal.SIGINT, None)
    assert handler.signal_name == "SIGINT" and stops == []
    now[0] += module.SAME_INTERRUPT_S  # a person pressing Ctrl-C again
    handler._handle(signal.SIGINT, None)
    assert stops == [now[0]]
