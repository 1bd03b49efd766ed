"""The data tools' worker pools end on SIGTERM whatever handler their parent runs.

``megazero.cli`` turns SIGTERM into an exception in the commands' process so that they clean up; a
forked worker inherited that handler, and a pool's ``terminate()`` (run at every pool's end)
then sometimes waited for ever on a worker that caught the signal as an exception and went back
to wait on the task queue the parent had locked (a test run of the curation pipeline and one of
``preprocess --workers 2`` hung so). Every pool's workers must have SIGTERM's default action."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from data_pipeline import worker_pool as worker_pool_module
from data_pipeline.curate.runner import LocalExecutor
from data_pipeline.worker_pool import worker_pool
from megazero.cli import _terminated


def _sigterm_action(_=None) -> dict:
    return {"sigterm": "default" if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL else "handled"}


def test_workers_take_sigterms_default_under_the_commands_handler(tmp_path):
    previous = signal.signal(signal.SIGTERM, _terminated)  # as megazero.cli installs it
    try:
        with worker_pool(2) as pool:
            direct = pool.map(_sigterm_action, range(4))
        executor = LocalExecutor(2)
        try:  # the curation pipeline's executor
            jobs = [(_sigterm_action, (), str(tmp_path / f"task{i}.json")) for i in range(4)]
            curated = list(executor.run(jobs))
        finally:
            executor.close()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert direct == curated == [{"sigterm": "default"}] * 4
    assert json.loads((tmp_path / "task0.json").read_text()) == {"sigterm": "default"}


def test_the_initializer_still_runs(tmp_path):
    pool = worker_pool(2, _mark, (str(tmp_path),))
    pids = set(pool.map(_marked_pid, range(8)))
    pool.close()
    pool.join()  # every worker has started (and run the initializer) and ended
    started = {p.name for p in tmp_path.iterdir()}
    assert len(started) == 2 and {f"{pid}.started" for pid in pids} <= started  # each worker, whether or not it got work


def _mark(folder: str) -> None:
    import os

    open(os.path.join(folder, f"{os.getpid()}.started"), "w").close()


def _marked_pid(_) -> int:
    import os

    return os.getpid()


def test_a_sigterm_sent_before_the_worker_drops_the_handler_still_ends_it():
    """The race behind a hung CI run: a worker forked under the commands' handler, sent SIGTERM (by a
    pool's ``terminate()``) before its start-up reset that handler. Workers start with SIGTERM blocked
    (``worker_pool``), so the signal waits, and the start-up must then let it end the worker. (Planted:
    without the unblock the process lives on and exits 0.)"""
    code = textwrap.dedent("""
        import os, signal
        from data_pipeline.worker_pool import _start_worker
        from megazero.cli import _terminated
        signal.signal(signal.SIGTERM, _terminated)  # inherited from the command
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # as worker_pool forks
        os.kill(os.getpid(), signal.SIGTERM)  # terminate() comes early
        _start_worker(None, ())
        print("still alive")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM and "still alive" not in done.stdout, (done.returncode, done.stderr)


@pytest.mark.parametrize("parent_blocks", [False, True])
def test_the_parent_keeps_its_signal_mask(parent_blocks):
    """Whichever mask the parent had, SIGTERM blocked or not, it has it back. The test sets it rather
    than takes it as found: a pool that leaked its block into an earlier test's process made the
    mask found here the blocked one, and the check compared the leak with itself."""
    how = signal.SIG_BLOCK if parent_blocks else signal.SIG_UNBLOCK
    previous = signal.pthread_sigmask(how, {signal.SIGTERM})
    try:
        before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
        with worker_pool(1) as pool:
            assert pool.map(_sigterm_action, range(2)) == [{"sigterm": "default"}] * 2
            assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def test_workers_are_forked_with_sigterm_blocked(tmp_path, monkeypatch):
    """The other half of the start-up race above, which blocks SIGTERM by hand as ``worker_pool``
    forks: the pool must fork its workers so, or a SIGTERM before the reset is lost again. Each
    worker notes its mask as its start-up begins."""
    start_worker = worker_pool_module._start_worker

    def noting_start(*args):
        blocked = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, set())
        (tmp_path / str(os.getpid())).write_text("blocked" if blocked else "unblocked")
        start_worker(*args)

    monkeypatch.setattr(worker_pool_module, "_start_worker", noting_start)  # forked: the workers see it
    pool = worker_pool(2)
    pool.close()
    pool.join()
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["blocked", "blocked"]


def _dies_on_3(i: int) -> int:
    if i == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer ends a worker
    return i


def _dies_on_3_task(i: int) -> dict:
    return {"i": _dies_on_3(i)}


def test_a_worker_killed_mid_task_fails_the_wait_instead_of_hanging_it(tmp_path):
    """A pool replaces a dead worker, but its task's result never comes: the curation stage and
    preprocessing waited for it for ever (planted: the bare imap). Both waits now end within
    seconds, naming the signal."""
    from data_pipeline.worker_pool import WorkerDied, watched

    with worker_pool(2) as pool:
        with pytest.raises(WorkerDied, match=r"was killed by signal 9 \(SIGKILL: out of memory\?\) while results of "
                                             r"a batch were awaited \(a task it ran is lost\)"):
            list(watched(pool, pool.imap(_dies_on_3, range(8), chunksize=1), "a batch"))
    executor = LocalExecutor(2)
    try:
        jobs = [(_dies_on_3_task, (i,), str(tmp_path / f"task{i}.json")) for i in range(6)]
        with pytest.raises(WorkerDied, match="while results of a task of this stage were awaited"):
            list(executor.run(jobs))
    finally:
        executor.close()


def _idles_or_sleeps(i: int) -> tuple:
    if i == 1:
        time.sleep(2)
    elif i == 2:
        os.kill(os.getpid(), signal.SIGRTMIN + 3)  # a signal without a name
    return i, os.getpid()


def test_a_signal_without_a_name_is_said_by_number():
    """A real-time signal has no name in ``signal.Signals``: looking one up raised ValueError in place
    of the message (planted: the lookup unguarded)."""
    from data_pipeline.worker_pool import WorkerDied, watched

    with worker_pool(2) as pool:
        with pytest.raises(WorkerDied, match=rf"was killed by signal {int(signal.SIGRTMIN) + 3} while"):
            list(watched(pool, pool.imap(_idles_or_sleeps, [2]), "a task"))
