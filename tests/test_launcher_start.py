"""The launch's start and end on every node: stop signals while the workers' interpreters start or
after this node's workers finished, rank 0's checks however long they take, and which node runs
rank 0. Through the real script (``scripts/pretrain_gpt.sh``) and launcher on gloo ranks."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.test_launcher_signals import (REPO, SCRIPT, SLOW_RANK_0, _children, _processes_of, _start, stop_leftovers,
                                         tiny_config)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return tiny_config(tmp_path_factory.mktemp("start"))


@pytest.fixture
def run_dir(tmp_path):
    """A unique run directory; whatever still runs under it afterwards is killed."""
    yield tmp_path / "run"
    stop_leftovers(tmp_path / "run")


def test_the_other_ranks_wait_for_rank_0s_checks_however_long(config, tmp_path):
    """Rank 0 scans the data before any process group exists; the other ranks went on to the
    rendezvous and gave up after ``train.collective_timeout_s``, so a first start on a large corpus
    failed there. They now wait for rank 0's verdict in torchrun's store. (Planted: no wait.)"""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_RANK_0.replace("time.sleep(3)", "time.sleep(8)"))
    env = dict(os.environ, CONFIG=str(config), NPROC_PER_NODE="2", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(REPO)]))
    done = subprocess.run([str(SCRIPT), "--logging.run_dir", str(tmp_path / "run"), "--train.train_steps", "2",
                           "--train.collective_timeout_s", "3"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "megazero: finished at step 2" in done.stdout, done.stdout


STARTING_WORKER = """
import os, time
if "LOCAL_RANK" in os.environ:  # a worker (not the launcher), while its interpreter starts
    open(os.path.join({marks!r}, str(os.getpid())), "w").close()
    time.sleep(3 + 3 * int(os.environ["LOCAL_RANK"]))  # rank 1 still starting when rank 0 has stopped
"""


def test_a_stop_signal_while_the_workers_start_waits_until_they_can_take_it(config, run_dir, tmp_path):
    """The launcher passed a stop signal on to workers whose interpreters were still starting: a
    SIGINT broke a worker's ``site`` import with a fatal-error traceback. The workers now start with
    the stop signals blocked and take them once ``megazero`` can. Rank 1 starts later, so when it
    unblocks it holds torchrun's SIGTERM (sent after rank 0's exit) beside the Ctrl-C: it stops on
    the Ctrl-C too (it died of the SIGTERM, status -15, a CI flake). (Planted: no blocking; the
    signals unblocked without taking the held ones as one stop.)"""
    site, marks = tmp_path / "site", tmp_path / "marks"
    site.mkdir()
    marks.mkdir()
    (site / "sitecustomize.py").write_text(STARTING_WORKER.format(marks=str(marks)))
    proc = _start(config, run_dir, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    deadline = time.monotonic() + 300
    while len(os.listdir(marks)) < 2:  # both workers are inside their start-up's sleep
        assert time.monotonic() < deadline and proc.poll() is None, "the workers did not start"
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGINT, out
    assert "Traceback" not in out and "Fatal Python error" not in out, out
    assert out.count("megazero train: interrupted") == 2, out
    assert "megazero: the workers stopped on SIGINT without saving (exit statuses 130)" in out, out
    assert _processes_of(run_dir) == []


NODE_WORKER = """
import os, sys, time
if os.environ["GROUP_RANK"] == "0":  # this node's worker finishes first
    open(sys.argv[1], "w").close()
else:  # the other node's a few seconds later
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
    time.sleep(4)
"""


def test_a_stop_signal_after_this_nodes_workers_finished_is_no_failure(tmp_path):
    """torchrun waits at its exit barrier for the other nodes' workers after its own have finished
    (it takes the signal once that wait ends): a stop signal there said "before the workers started"
    and exited 143, a finished node reading as stopped. (Planted: no look at the workers that ran.)"""
    worker, done = tmp_path / "worker.py", tmp_path / "finished"
    worker.write_text(NODE_WORKER)
    port = _free_port()
    launchers = [subprocess.Popen([sys.executable, "-m", "parallel.launch", "--nnodes", "2", "--node_rank", str(node),
                                   "--master_addr", "127.0.0.1", "--master_port", str(port), "--nproc_per_node",
                                   "1", str(worker), str(done)],
                                  cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
                 for node in (0, 1)]
    try:
        deadline = time.monotonic() + 300
        while not (done.exists() and _children(launchers[0].pid) == []):  # node 0 waits at its exit barrier
            assert time.monotonic() < deadline and launchers[0].poll() is None, launchers[0].communicate()[0]
            time.sleep(0.05)
        launchers[0].send_signal(signal.SIGTERM)
        out, _ = launchers[0].communicate(timeout=60)
    finally:
        for launcher in launchers:
            with contextlib.suppress(ProcessLookupError):  # gone with its session
                os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launchers[0].returncode == 0, out
    assert "megazero: SIGTERM after this node's workers finished; nothing to save" in out, out
    assert "Traceback" not in out, out


def test_node_rank_0_runs_rank_0_whichever_node_starts_first(config, tmp_path):
    """Two nodes on this host, node 1 started first: under torchrun's c10d rendezvous the node that
    joined with the lower process id became node 0, and rank 0 ran on NODE_RANK 1. (Planted: c10d.)"""
    env = dict(os.environ, CONFIG=str(config), NPROC_PER_NODE="1", OMP_NUM_THREADS="1", NNODES="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    args = [str(SCRIPT), "--logging.run_dir", str(tmp_path / "run"), "--train.train_steps", "2"]
    nodes = {}
    for node in (1, 0):
        nodes[node] = subprocess.Popen(args, cwd=REPO, env=dict(env, NODE_RANK=str(node)), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, start_new_session=True)
        time.sleep(2 if node == 1 else 0)
    out = {node: proc.communicate(timeout=300)[0] for node, proc in nodes.items()}
    assert [nodes[0].returncode, nodes[1].returncode] == [0, 0], out
    assert "megazero: finished at step 2" in out[0] and "finished at step" not in out[1], out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ORPHANED_WORKER = """
import os, sys, time
from parallel.launch import exit_with_launcher

exit_with_launcher(0)  # as a worker does before it waits for its peers
time.sleep(60)
print("still running", flush=True)
"""


def test_a_worker_whose_launcher_ended_while_it_started_exits_at_once():
    """A Ctrl-C as torchrun spawned a worker ended the launcher before the worker watched it: the
    worker, handed to init meanwhile, watched init and waited at a gone rendezvous for its whole
    timeout, holding the launch's output open (a CI run's test timed out on it). The launcher now
    names itself to its workers, which end at once where their parent is no longer it (planted:
    the parent at the time of watching taken, which here is alive, so the worker slept on)."""
    from parallel.launch import EXIT_ORPHANED, LAUNCHER_PID

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # the launcher that started the worker, ended
    env = dict(os.environ, **{LAUNCHER_PID: str(gone.pid)})
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", ORPHANED_WORKER], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=50)
    assert done.returncode == EXIT_ORPHANED and "still running" not in done.stdout, done
    assert f"rank 0: its launcher (pid {gone.pid}) is gone; stopping without saving" in done.stderr, done.stderr
    assert time.monotonic() - started < 30
