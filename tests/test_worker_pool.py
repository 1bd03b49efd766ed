"""The data tools' worker pools end on SIGTERM whatever handler their parent runs, and end the
command with one line when a worker dies, busy or idle.

``megazero.cli`` turns SIGTERM into an exception in the commands' process so that they clean up; a
forked worker inherited that handler, and a pool's end (which sends its workers SIGTERM) then
sometimes waited for ever on a worker that caught the signal as an exception (a test run of the
curation pipeline and one of ``preprocess --workers 2`` hung so). Every pool's workers must have
SIGTERM's default action."""

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
from data_pipeline.worker_pool import WorkerDied, WorkerPool
from megazero.errors import raise_terminated


def _sigterm_action(_=None) -> dict:
    return {"sigterm": "default" if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL else "handled"}


def test_workers_take_sigterms_default_under_the_commands_handler(tmp_path):
    previous = signal.signal(signal.SIGTERM, raise_terminated)  # as megazero.cli installs it
    try:
        with WorkerPool(2) as pool:
            direct = list(pool.imap(_sigterm_action, range(4), "a test"))
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


def test_the_initializer_runs_in_every_worker(tmp_path):
    with WorkerPool(2, _mark, (str(tmp_path),)) as pool:
        pids = set(pool.imap(_marked_pid, range(8), "a test", ordered=False))
        started = _wait_for_files(tmp_path, 2)  # each worker, whether or not it got work
    assert {f"{pid}.started" for pid in pids} <= started


def _wait_for_files(folder, count: int) -> set:
    deadline = time.monotonic() + 60
    while len(list(folder.iterdir())) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return {p.name for p in folder.iterdir()}


def _mark(folder: str) -> None:
    open(os.path.join(folder, f"{os.getpid()}.started"), "w").close()


def _marked_pid(_) -> int:
    return os.getpid()


def test_results_come_in_order_or_as_they_finish_and_the_jobs_are_read_as_needed():
    """``imap`` keeps the jobs' order unless told not to, and takes jobs from the iterable only a few
    a worker ahead of the results taken (preprocessing hands it a whole corpus's batches)."""
    taken = []

    def jobs():
        for i in range(40):
            taken.append(i)
            yield i

    with WorkerPool(2) as pool:
        ordered = pool.imap(_square_after, jobs(), "a test")
        assert next(ordered) == 0 and len(taken) <= 2 * worker_pool_module.AHEAD
        assert list(ordered) == [i * i for i in range(1, 40)]
        finished = list(pool.imap(_square_after, [500, 0], "a test", ordered=False))
    assert finished == [0, 250000]  # the job of 0 ms is back first


def _square_after(i: int) -> int:
    time.sleep(i / 1000)
    return i * i


def test_a_tasks_exception_is_raised_as_itself():
    with WorkerPool(2) as pool:
        with pytest.raises(ValueError, match="bad record 3"):
            list(pool.imap(_fails_on_3, range(6), "a test"))


def _fails_on_3(i: int) -> int:
    if i == 3:
        raise ValueError("bad record 3")
    return i


def test_a_sigterm_sent_before_the_worker_drops_the_handler_still_ends_it():
    """The race behind a hung CI run: a worker forked under the commands' handler, sent SIGTERM (by a
    pool's ``terminate()``) before its start-up reset that handler. Workers start with SIGTERM blocked
    (``worker_pool``), so the signal waits, and the start-up must then let it end the worker. (Planted:
    without the unblock the process lives on and exits 0.)"""
    code = textwrap.dedent("""
        import os, signal
        from data_pipeline.worker_pool import _start_worker
        from megazero.errors import raise_terminated
        signal.signal(signal.SIGTERM, raise_terminated)  # inherited from the command
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # as worker_pool forks
        os.kill(os.getpid(), signal.SIGTERM)  # terminate() comes early
        _start_worker(os.getppid(), None, ())
        print("still alive")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM and "still alive" not in done.stdout, (done.returncode, done.stderr)


def test_workers_end_when_their_parent_is_killed_outright():
    """A command killed with SIGKILL (or by the OOM killer) runs no clean-up: its workers, waiting on
    their pipes to it, lived on for good, holding the locks of its temporary files. They now end
    with it. (Planted: no parent-death signal.)"""
    code = textwrap.dedent("""
        import time
        from data_pipeline.worker_pool import WorkerPool
        with WorkerPool(2) as pool:
            list(pool.imap(time.sleep, [60] * 4, "sleeping"))
    """)
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        workers: list[int] = []
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
            workers = [int(pid) for task in os.listdir(f"/proc/{parent.pid}/task")
                       for pid in _read(f"/proc/{parent.pid}/task/{task}/children").split()]
        assert len(workers) == 2, workers
        time.sleep(0.5)  # past their start-up
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(os.path.exists(f"/proc/{pid}") for pid in workers), "workers outlived their parent by 10 s"
    finally:
        parent.kill()


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:  # a thread that just ended
        return ""


@pytest.mark.parametrize("parent_blocks", [False, True])
def test_the_parent_keeps_its_signal_mask(parent_blocks):
    """Whichever mask the parent had, SIGTERM blocked or not, it has it back. The test sets it rather
    than takes it as found: a pool that leaked its block into an earlier test's process made the
    mask found here the blocked one, and the check compared the leak with itself."""
    how = signal.SIG_BLOCK if parent_blocks else signal.SIG_UNBLOCK
    previous = signal.pthread_sigmask(how, {signal.SIGTERM})
    try:
        before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
        with WorkerPool(1) as pool:
            assert list(pool.imap(_sigterm_action, range(2), "a test")) == [{"sigterm": "default"}] * 2
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
    with WorkerPool(2) as pool:
        list(pool.imap(_marked_pid, range(2), "a test"))  # the workers are forked at the first task
        _wait_for_files(tmp_path, 2)
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["blocked", "blocked"]


def _dies_on_3(i: int) -> int:
    if i == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer ends a worker
    return i


def _dies_on_3_task(i: int) -> dict:
    return {"i": _dies_on_3(i)}


def test_a_worker_killed_mid_task_fails_the_wait_instead_of_hanging_it(tmp_path):
    """A ``multiprocessing.Pool`` replaces a dead worker, but its task's result never comes: the
    curation stage and preprocessing waited for it for ever. Both waits now end within seconds,
    naming the signal."""
    with WorkerPool(2) as pool:
        with pytest.raises(WorkerDied, match=r"was killed by signal 9 \(SIGKILL: out of memory\?\) while results of "
                                             r"a batch were awaited \(the tasks running are lost\)"):
            list(pool.imap(_dies_on_3, range(8), "a batch"))
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
    with WorkerPool(2) as pool:
        with pytest.raises(WorkerDied, match=rf"was killed by signal {int(signal.SIGRTMIN) + 3} while"):
            list(pool.imap(_idles_or_sleeps, [2], "a task"))


def test_a_worker_killed_while_idle_ends_the_pool_too():
    """An idle worker waits for tasks holding the task queue's lock: killed there, it left the lock
    taken, and ``multiprocessing.Pool``'s end waited on it for ever (planted: this script on a
    ``Pool``, which hangs). The pool now fails the wait at once, naming the signal, and its end
    kills the busy worker instead of waiting out its task. Run in a process of its own, so that a
    hang is a failed test, not a hung suite."""
    code = textwrap.dedent("""
        import time
        from data_pipeline.worker_pool import WorkerDied, WorkerPool
        from tests.test_worker_pool import _kills_the_others
        start = time.monotonic()
        with WorkerPool(3) as pool:
            list(pool.imap(_kills_the_others, [()], "a start"))  # every worker is forked at the first task
            try:
                list(pool.imap(_kills_the_others, [tuple(pool._processes)], "a long task"))
            except WorkerDied as exc:
                print(exc)
        print(f"ended after {time.monotonic() - start:.1f} s")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    said, ended = done.stdout.splitlines()
    assert "was killed by signal 9 (SIGKILL: out of memory?) while results of a long task were awaited" in said
    assert float(ended.split()[2]) < 20  # the long task sleeps 30 s: it was killed, not waited for


def _kills_the_others(pids: tuple) -> None:
    """Kill every other worker (idle: there is one task), then work for 30 s."""
    if pids:
        for pid in pids:
            if pid != os.getpid():
                os.kill(pid, signal.SIGKILL)
        time.sleep(30)


def test_a_worker_killed_while_it_sends_its_result_ends_the_pool_too():
    """A worker killed part-way through sending a large result (where it holds the most memory, so
    where the OOM killer finds it) left the executor's own watch reading the rest of the message for
    ever: no result failed, and the pool's end waited on that read. So did a pool stopped while its
    workers sent results. Both now end within seconds. (Planted: no look at the workers while
    waiting, and the results pipe left open at the end: the script hangs.)"""
    code = textwrap.dedent("""
        import time
        from data_pipeline.worker_pool import WorkerDied, WorkerPool
        from tests.test_worker_pool import _dies_while_sending, _large
        start = time.monotonic()
        for delay in [0.02 * i for i in range(2, 10)]:  # some land while the result is being sent
            with WorkerPool(1) as pool:
                try:
                    list(pool.imap(_dies_while_sending, [delay], "a large result"))
                    print("no death")
                except WorkerDied as exc:
                    print(exc)
        for _ in range(3):
            pool = WorkerPool(2)
            results = pool.imap(_large, [200_000] * 40, "a test")
            for _ in range(5):
                next(results)
            pool.close()
        print(f"ended after {time.monotonic() - start:.1f} s")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    *said, ended = done.stdout.splitlines()
    died = [line for line in said if "was killed by signal 9 (SIGKILL: out of memory?) while results of a large "
            "result" in line]
    assert died and len(died) + said.count("no death") == len(said), said  # a fast sender may finish first
    assert float(ended.split()[2]) < 60


def _dies_while_sending(delay: float) -> bytes:
    import threading

    threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    return b"x" * 100_000_000


def _large(size: int) -> bytes:
    time.sleep(0.01)
    return b"x" * size
