"""The deadline on the host's waits for its device (``megazero.device_watchdog``): a wait that never
ends stops the process with one line; waits that each end in time never do, however many."""

import subprocess
import sys
import textwrap
import time

from megazero.device_watchdog import EXIT_STATUS, DeviceWatchdog


def test_a_wait_that_never_ends_stops_the_process_with_one_line():
    # the main thread blocks for good, as a host does inside the CUDA driver: only the watchdog's
    # thread can end the process
    code = textwrap.dedent("""
        import threading
        from megazero.device_watchdog import DeviceWatchdog
        watchdog = DeviceWatchdog(0.5, rank=3, describe=lambda: "stopping now loses steps 5-7")
        with watchdog.waiting("step 7's results"):
            threading.Event().wait()
    """)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_STATUS
    assert time.monotonic() - start < 30
    assert done.stderr.splitlines() == [
        "megazero: rank 3 waited 0.525 s for step 7's results on its device (train.collective_timeout_s, and 5%): a "
        "collective, or a peer rank, is stuck; stopping this rank; stopping now loses steps 5-7"]


def test_each_wait_has_its_own_deadline():
    stops = []
    with DeviceWatchdog(0.3, rank=0, exit=stops.append) as watchdog:
        for step in range(8):  # 0.4 s of waiting in all, each wait 0.05 s
            with watchdog.waiting(f"step {step}'s results"):
                time.sleep(0.05)
        time.sleep(0.5)  # the host's own work after a wait has no deadline
    assert stops == []


def test_a_late_wait_is_caught_after_waits_in_time(capsys):
    stops = []
    with DeviceWatchdog(0.2, rank=1, exit=stops.append) as watchdog:
        with watchdog.waiting("step 1's results"):
            time.sleep(0.01)
        with watchdog.waiting("step 2's results"):
            deadline = time.monotonic() + 10
            while not stops and time.monotonic() < deadline:
                time.sleep(0.01)
    assert stops == [EXIT_STATUS]
    assert "rank 1 waited 0.21 s for step 2's results" in capsys.readouterr().err


def test_without_a_deadline_nothing_is_watched():
    stops = []
    with DeviceWatchdog(None, rank=0, exit=stops.append) as watchdog:
        with watchdog.waiting("step 1's results"):
            time.sleep(0.2)
        assert watchdog._thread is None
    assert stops == []


def test_a_wait_after_close_is_watched_again():
    """``Trainer.train`` closes its watchdog as it returns; a second call must be watched too."""
    stops = []
    watchdog = DeviceWatchdog(0.2, rank=0, exit=stops.append)
    with watchdog:
        with watchdog.waiting("step 1's results"):
            time.sleep(0.01)
    with watchdog:
        with watchdog.waiting("step 9's results"):
            deadline = time.monotonic() + 10
            while not stops and time.monotonic() < deadline:
                time.sleep(0.01)
    assert stops == [3]


def test_a_failing_description_still_ends_the_rank(capsys):
    def describe():
        raise RuntimeError("state torn")
    stops = []
    with DeviceWatchdog(0.1, rank=0, describe=describe, exit=stops.append) as watchdog:
        with watchdog.waiting("step 2's results"):
            deadline = time.monotonic() + 10
            while not stops and time.monotonic() < deadline:
                time.sleep(0.01)
    assert stops == [3]
    assert "what stopping loses is unknown: state torn" in capsys.readouterr().err
