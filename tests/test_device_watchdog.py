"""The deadline on the host's waits for its device (``megazero.device_watchdog``): a wait that never
ends stops the process with one line; waits that each end in time never do, however many."""

import subprocess
import sys
import textwrap
import time

from megazero.device_watchdog import EXIT_STATUS, MARGIN, DeviceWatchdog


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
    err = capsys.readouterr().err
    assert "rank 1 waited 0.21 s for step 2's results" in err
    assert err.endswith("stopping this rank\n")  # nothing to add: no dangling "; "


def test_a_wait_after_host_work_past_the_deadline_is_caught():
    """The host's own work between waits (a checkpoint written, an evaluation's batches read) may
    outlast the deadline; the watchdog's thread, idle meanwhile, must still take up the next wait.
    (Planted: without the notify as a wait begins, the thread slept on for ever and missed it.)"""
    stops = []
    with DeviceWatchdog(0.1, rank=0, exit=stops.append) as watchdog:
        with watchdog.waiting("step 1's results"):
            time.sleep(0.01)
        time.sleep(0.3)  # past step 1's deadline, with nothing waited for
        with watchdog.waiting("step 2's results"):
            deadline = time.monotonic() + 10
            while not stops and time.monotonic() < deadline:
                time.sleep(0.01)
    assert stops == [EXIT_STATUS]


def test_the_deadline_falls_after_nccls():
    """NCCL's watchdog fails a collective it launched at the timeout and names the operation and its
    group; this one must come after it (``MARGIN``), never first. The stop cannot come early, so the
    lower bound cannot flake."""
    stops, described = [], []
    with DeviceWatchdog(1.0, rank=0, describe=lambda: described.append(time.monotonic()) or "",
                        exit=stops.append) as watchdog:
        start = time.monotonic()
        with watchdog.waiting("step 1's results"):
            deadline = start + 10
            while not stops and time.monotonic() < deadline:
                time.sleep(0.01)
    assert stops == [EXIT_STATUS]
    assert described[0] - start >= 1.0 * MARGIN


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
