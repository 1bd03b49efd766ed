"""One job per run directory: a second job is refused naming the holder; stale locks are taken over."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from megazero.run_lock import LOCK_FILE, RunDirBusy, RunDirLock
from tests.bad_input_files import _train, make_files


def _taken_once_stale(tmp_path) -> None:
    """The lock file, left untouched past ``stale_after_s``, is taken over by the next job."""
    old = time.time() - 120
    os.utime(tmp_path / LOCK_FILE, (old, old))
    with RunDirLock(tmp_path, stale_after_s=60) as lock:
        assert lock.holder() == lock.record


def test_a_second_holder_is_refused_naming_host_and_pid(tmp_path):
    with RunDirLock(tmp_path):
        other = RunDirLock(tmp_path)
        other.record = {**other.record, "pid": os.getpid() + 1}  # another job of this host
        with pytest.raises(RunDirBusy, match=rf"in use by pid {os.getpid()} on host \S+ \(since"):
            other.acquire()
    assert not (tmp_path / LOCK_FILE).exists(), "release removes the lock"


def test_a_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    holder = RunDirLock(tmp_path).record
    (tmp_path / LOCK_FILE).write_text(json.dumps({**holder, "pid": dead.pid}))
    with RunDirLock(tmp_path) as lock:
        assert lock.holder() == lock.record
    assert "took over a stale lock" in capsys.readouterr().out


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="zombie states are read from /proc")
def test_a_lock_of_a_killed_process_not_yet_reaped_is_taken_over(tmp_path, capsys):
    """After ``kill -9`` of a whole launch the ranks are zombies until init reaps them, for seconds on
    some machines; a relaunch in that window found the lock "in use" and refused to resume."""
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":  # exited, not reaped
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        holder = RunDirLock(tmp_path).record
        (tmp_path / LOCK_FILE).write_text(json.dumps({**holder, "pid": zombie.pid}))
        with RunDirLock(tmp_path) as lock:
            assert lock.holder() == lock.record
        assert "took over a stale lock" in capsys.readouterr().out
    finally:
        zombie.wait()


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="process start times are read from /proc")
def test_a_lock_whose_pid_now_runs_another_process_is_taken_over(tmp_path, capsys):
    """After a reboot pids are handed out again, often the same low ones: the dead holder's pid ran
    another process, and the lock was in use for ever (planted: the pid's liveness alone). The holder's identity (boot
    and start time) tells them apart; a holder whose identity matches keeps its lock."""
    live = RunDirLock(tmp_path).record
    assert live["process"] is not None
    (tmp_path / LOCK_FILE).write_text(json.dumps(live))
    with pytest.raises(RunDirBusy, match=rf"in use by pid {os.getpid()} "):
        RunDirLock(tmp_path).acquire()
    boot, start = live["process"].split(":")
    (tmp_path / LOCK_FILE).write_text(json.dumps({**live, "process": f"{boot}:{int(start) - 1}"}))
    with RunDirLock(tmp_path) as lock:
        assert lock.holder() == lock.record
    assert "took over a stale lock" in capsys.readouterr().out


def test_a_lock_of_another_pid_namespace_is_stale_only_once_its_heartbeat_stops(tmp_path):
    """Two containers with the host's network share its name but number their processes apart: the
    holder's pid, absent here, was taken for a dead job and a live job's lock taken over at once
    (planted: the namespace not compared)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    holder = {**RunDirLock(tmp_path).record, "pid": dead.pid, "pid_ns": "pid:[1]"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(holder))
    with pytest.raises(RunDirBusy, match=rf"in use by pid {dead.pid} "):
        RunDirLock(tmp_path, stale_after_s=60).acquire()
    _taken_once_stale(tmp_path)


def test_a_live_pid_of_an_older_record_is_stale_once_its_heartbeat_stops(tmp_path):
    """A record of an older version holds no process identity: its pid running after a container's
    restart (another process, or the relaunched job itself) kept the lock in use for ever (planted:
    the pid's liveness alone); the heartbeat, which a live holder keeps, decides."""
    old = {key: value for key, value in RunDirLock(tmp_path).record.items() if key not in ("pid_ns", "process")}
    (tmp_path / LOCK_FILE).write_text(json.dumps(old))
    with pytest.raises(RunDirBusy, match=rf"in use by pid {os.getpid()} "):
        RunDirLock(tmp_path, stale_after_s=60).acquire()
    _taken_once_stale(tmp_path)


def test_another_hosts_lock_is_stale_only_once_its_heartbeat_stops(tmp_path):
    foreign = {"host": "node-that-is-not-this-one", "pid": 1, "started": time.time()}
    (tmp_path / LOCK_FILE).write_text(json.dumps(foreign))
    with pytest.raises(RunDirBusy, match="node-that-is-not-this-one"):
        RunDirLock(tmp_path, stale_after_s=60).acquire()
    _taken_once_stale(tmp_path)


def test_the_holder_refreshes_its_heartbeat(tmp_path):
    with RunDirLock(tmp_path, heartbeat_s=0.05):
        path = tmp_path / LOCK_FILE
        old = time.time() - 1000
        os.utime(path, (old, old))
        time.sleep(0.3)
        assert time.time() - path.stat().st_mtime < 100


def test_a_run_directory_that_cannot_be_written_is_one_user_error(tmp_path):
    from megazero.errors import UserError

    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="cannot write the run directory"):
        RunDirLock(tmp_path / "file" / "run").acquire()


def test_a_run_directory_this_user_cannot_write_is_refused_before_the_run(tmp_path, monkeypatch):
    """Preflight finds what the lock would, before any process starts: a folder, or the nearest one
    above a folder not made yet, that this user may not write or enter. (Root writes anywhere, so the
    refusal is simulated; planted: asked whether it can be read, passed.)"""
    import megazero.preflight as preflight

    monkeypatch.setattr(preflight.os, "access", lambda path, mode: not mode & (os.W_OK | os.X_OK))
    assert preflight._unwritable(str(tmp_path)) == "is not writable"
    assert preflight._unwritable(str(tmp_path / "new" / "run")) == f"cannot be created ({tmp_path} is not writable)"
    monkeypatch.undo()
    assert preflight._unwritable(str(tmp_path / "new" / "run")) is None


def _locked(run_dir, save_dir=None) -> list:
    import dataclasses

    from megazero.config.schema import Config
    from megazero.startup import lock_directories

    cfg = Config()
    cfg = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, run_dir=str(run_dir)),
                              checkpoint=dataclasses.replace(cfg.checkpoint, save_dir=save_dir))
    return lock_directories(cfg)


def test_a_job_locks_its_checkpoint_directory_and_not_its_run_directory_twice(tmp_path, monkeypatch):
    """Two jobs of their own run directories could share one save_dir; a save_dir that is the run
    directory under another name (here a symlink, a relative path) is one directory, whose lock the
    job must not take for another job's."""
    locks = _locked(tmp_path / "run")  # the default: RUN_DIR/checkpoints, a directory of its own
    assert [lock.path for lock in locks] == [tmp_path / "run" / LOCK_FILE, tmp_path / "run" / "checkpoints" / LOCK_FILE]
    with pytest.raises(RunDirBusy, match="checkpoint directory is in use by .*checkpoint.save_dir"):
        _locked(tmp_path / "other", save_dir=str(tmp_path / "run" / "checkpoints"))
    assert not (tmp_path / "other" / LOCK_FILE).exists()  # the run directory's lock is given back
    for lock in reversed(locks):
        lock.release()
    os.symlink(tmp_path / "run", tmp_path / "alias")
    monkeypatch.chdir(tmp_path)
    for save_dir in (str(tmp_path / "alias"), "run"):
        locks = _locked(tmp_path / "run", save_dir=save_dir)
        assert [lock.path for lock in locks] == [tmp_path / "run" / LOCK_FILE]
        locks[0].release()


def test_a_checkpoint_directory_that_cannot_be_written_names_its_setting(tmp_path):
    """The checkpoint directory's lock is taken beside the run directory's: where it cannot be written,
    the error must name checkpoint.save_dir (logging.run_dir is fine and would send the user to the
    wrong setting), and the run directory's lock is given back."""
    from megazero.errors import UserError

    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="cannot write the checkpoint directory .*; set checkpoint.save_dir to"):
        _locked(tmp_path / "run", save_dir=str(tmp_path / "file" / "checkpoints"))
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_release_leaves_a_lock_another_job_took_over(tmp_path):
    """A job whose heartbeat stalled past ``stale_after_s`` has had its lock taken over by another
    job; as it ends, its release must not delete the lock the other job now holds."""
    lock = RunDirLock(tmp_path).acquire()
    successor = {"host": "node-that-is-not-this-one", "pid": 1, "started": time.time()}
    (tmp_path / LOCK_FILE).write_text(json.dumps(successor))
    lock.release()
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == successor


def test_of_two_jobs_taking_over_at_once_the_one_renamed_last_wins(tmp_path, monkeypatch, capsys):
    """Two jobs that find one stale lock both rename their record over it; the lock file holds the
    record renamed last, and the job whose record was replaced must read that back and be refused,
    not run beside the winner in the same directory."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    holder = RunDirLock(tmp_path).record
    (tmp_path / LOCK_FILE).write_text(json.dumps({**holder, "pid": dead.pid}))
    winner = {"host": "node-that-is-not-this-one", "pid": 4242, "started": time.time()}
    real_replace = os.replace

    def replace_then_lose(src, dst):
        real_replace(src, dst)
        (tmp_path / "winner").write_text(json.dumps(winner))
        real_replace(tmp_path / "winner", dst)  # the other job's rename lands just after ours

    monkeypatch.setattr(os, "replace", replace_then_lose)
    lock = RunDirLock(tmp_path)
    with pytest.raises(RunDirBusy, match="in use by pid 4242 on host node-that-is-not-this-one"):
        lock.acquire()
    assert lock._thread is None and "took over" not in capsys.readouterr().out
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == winner


def test_a_live_process_of_another_user_keeps_its_lock(tmp_path, monkeypatch):
    """Signalling another user's process fails with PermissionError although it runs: its lock is
    in use, not stale. (The tests run as root, whom no signal refuses, so the refusal is simulated.)"""
    def refused(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    holder = {**RunDirLock(tmp_path).record, "pid": os.getpid()}  # a live pid whose /proc entry says so
    (tmp_path / LOCK_FILE).write_text(json.dumps(holder))
    monkeypatch.setattr(os, "kill", refused)
    with pytest.raises(RunDirBusy, match=rf"in use by pid {os.getpid()} "):
        RunDirLock(tmp_path).acquire()


def test_without_proc_a_live_holder_is_trusted_to_the_signal(tmp_path, monkeypatch):
    """Where ``/proc`` cannot be read (another OS, or the entry gone) the signal's answer stands: a
    holder the signal reaches is alive and keeps its lock."""
    import megazero.run_lock as run_lock

    def no_proc(path, *args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", path)

    holder = {**RunDirLock(tmp_path).record, "pid": os.getpid()}
    (tmp_path / LOCK_FILE).write_text(json.dumps(holder))
    monkeypatch.setattr(run_lock, "open", no_proc, raising=False)
    with pytest.raises(RunDirBusy, match="is in use by"):
        RunDirLock(tmp_path).acquire()


def test_an_unreadable_lock_is_in_use_until_its_heartbeat_stops(tmp_path):
    """A lock file cut short (a full disk, a write in progress) names no holder: it is refused as in
    use while fresh, saying so, and taken over once untouched for ``stale_after_s``."""
    (tmp_path / LOCK_FILE).write_text('{"host": "no')
    with pytest.raises(RunDirBusy, match=r"in use by another job \(its lock file is unreadable\)"):
        RunDirLock(tmp_path, stale_after_s=60).acquire()
    _taken_once_stale(tmp_path)


@pytest.mark.parametrize("record", [
    42, ["host", 1], {"host": "HOST"}, {"host": "HOST", "pid": "1", "started": 0},
    {"host": "HOST", "pid": -1, "started": 0}, {"host": "HOST", "pid": 2**40, "started": 0},
    {"host": "HOST", "pid": True, "started": 0}, {"host": "HOST", "pid": 1, "started": "today"},
    {"host": "HOST", "pid": 1, "started": 1e300}, {"host": None, "pid": 1, "started": 0},
    {"host": "HOST", "pid": 1, "started": 0, "process": 7}])
def test_a_lock_that_holds_no_record_of_a_job_is_in_use_until_its_heartbeat_stops(tmp_path, record):
    """A lock file of valid JSON but no record this module writes (another tool's, or edited by hand)
    names no process to look for: it is an unreadable lock, not a traceback (a number or a list, a
    pid or start time of the wrong type), nor a lock of this host in use for ever (no pid, or pid -1,
    which signals every process this user may signal). (Planted before the fix: each case raised,
    or was refused with the takeover never coming.)"""
    import socket

    text = json.dumps(record).replace("HOST", socket.gethostname())
    (tmp_path / LOCK_FILE).write_text(text)
    with pytest.raises(RunDirBusy, match=r"in use by another job \(its lock file is unreadable\)"):
        RunDirLock(tmp_path, stale_after_s=60).acquire()
    _taken_once_stale(tmp_path)


def test_a_lock_released_while_it_is_read_is_taken(tmp_path):
    """The holder may release its lock between this job finding the file and reading it: a lock gone
    by then is free, not a job's whose record cannot be read."""
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "node-that-is-not-this-one", "pid": 1, "started": 0}))
    lock = RunDirLock(tmp_path)

    def released_meanwhile():
        (tmp_path / LOCK_FILE).unlink()
        del lock.holder  # back to the method for the read-back
        return None

    lock.holder = released_meanwhile
    with lock:
        assert json.loads((tmp_path / LOCK_FILE).read_text()) == lock.record


def test_a_run_directory_is_made_with_its_parents_and_the_message_counts_minutes(tmp_path):
    """``runs/NAME`` in a fresh checkout has no ``runs`` yet; and the refusal gives the takeover delay in
    minutes, as it says."""
    with RunDirLock(tmp_path / "runs" / "first"):
        other = RunDirLock(tmp_path / "runs" / "first")
        other.record = {**other.record, "pid": os.getpid() + 1}
        with pytest.raises(RunDirBusy, match="taken over after 10 minutes;"):
            other.acquire()


def test_only_the_jobs_rank_0_locks_its_directories(monkeypatch):
    """Every node has a local rank 0; on the shared filesystem of a multi-node job, a second node's
    taking the lock would find it held by its own job's rank 0 and refuse the run."""
    import megazero.startup as startup
    from megazero.config.schema import Config
    from parallel.launch import LaunchEnv

    locked = []
    monkeypatch.setattr(startup, "lock_directories", lambda cfg: locked.append(cfg) or [])

    def started(cfg, launch):
        raise RuntimeError("stopped after the locks")

    monkeypatch.setattr(startup, "initialize", started)
    for rank, local_rank in ((0, 0), (8, 0), (3, 3)):  # two nodes of 8 ranks
        with pytest.raises(RuntimeError, match="stopped after the locks"):
            startup.start_run(Config(), LaunchEnv(rank, 16, local_rank, 8))
    assert len(locked) == 1


def test_a_stale_lock_in_a_directory_that_cannot_be_written_is_one_user_error(tmp_path, monkeypatch):
    """Taking over a stale lock writes the directory as creating one does: where that fails (another
    user's run directory, a read-only mount), the user gets the same one line naming the setting, not
    a traceback. (Root writes anywhere, so the refusal is simulated.)"""
    from megazero.errors import UserError

    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "node-that-is-not-this-one", "pid": 1, "started": 0}))
    old = time.time() - 1200
    os.utime(tmp_path / LOCK_FILE, (old, old))

    def refused(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(UserError, match="cannot write the run directory .Permission denied.; set logging.run_dir"):
        RunDirLock(tmp_path).acquire()
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]  # the record written for the rename is gone


def test_a_lock_that_cannot_be_removed_is_one_warning_not_an_error(tmp_path, monkeypatch, capsys):
    """A save folder turned read-only under a run: the save's own one-line error is the news, and the
    lock's removal at the end (in a ``finally``) replaced it with a traceback. It is a warning."""
    from pathlib import Path

    def read_only(self, missing_ok=False):
        raise OSError(30, "Read-only file system")
    with RunDirLock(tmp_path):
        monkeypatch.setattr(Path, "unlink", read_only)
    assert "could not remove the run lock" in capsys.readouterr().err
    assert (tmp_path / LOCK_FILE).exists()  # left for the next launch, which finds its pid gone


def test_busy_names_a_live_holder_without_taking_the_lock(tmp_path):
    """What a launch asks before its other checks: a live holder's message; none for no lock or a dead
    holder's (whose run the relaunch resumes); and the file untouched either way."""
    assert RunDirLock(tmp_path).busy() is None and not (tmp_path / LOCK_FILE).exists()
    with RunDirLock(tmp_path) as held:
        message = RunDirLock(tmp_path).busy()
        assert message.startswith(f"{tmp_path}: run directory is in use by pid {os.getpid()} "), message
        assert held.holder() == held.record
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_FILE).write_text(json.dumps({**RunDirLock(tmp_path).record, "pid": dead.pid}))
    before = (tmp_path / LOCK_FILE).read_text()
    assert RunDirLock(tmp_path).busy() is None
    assert (tmp_path / LOCK_FILE).read_text() == before


def test_the_lock_names_its_job_by_the_rendezvous_address(tmp_path, monkeypatch):
    """Every rank of a job sees one ``MASTER_ADDR:MASTER_PORT`` and run id, and no two live jobs can
    bind one address: the record written by rank 0 carries it for the other nodes' checks; a
    launch without one names no job, and a record whose job is not text is not this module's."""
    from megazero.run_lock import job_identity

    assert job_identity({}) is None and job_identity({"MASTER_ADDR": "n1"}) is None
    monkeypatch.setenv("MASTER_ADDR", "n1")
    monkeypatch.setenv("MASTER_PORT", "29400")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "4242")
    with RunDirLock(tmp_path) as held:
        assert held.holder()["job"] == "n1:29400/4242" == job_identity()
        assert RunDirLock(tmp_path).busy(own_job="n1:29400/4242") is None
        assert "in use by" in RunDirLock(tmp_path).busy(own_job="n1:29401/4242")
    record = {**RunDirLock(tmp_path).record, "job": 5}
    (tmp_path / LOCK_FILE).write_text(json.dumps(record))
    assert RunDirLock(tmp_path).holder() is None


def test_another_nodes_first_rank_tells_a_live_jobs_lock_from_its_own(tmp_path_factory, tmp_path, monkeypatch):
    """A launch into a live job's run directory, with a config other than that job's: the first rank
    of another node, which reports too, spoke of the live job's checkpoint (its layer count) where
    rank 0 said the directory is in use. It now asks the lock as well and skips those checks, but
    leaves the verdict to rank 0 (a dead holder on rank 0's host is taken over at once, where this
    host would wait out the heartbeat); a lock of its own job, which its rank 0 may hold by then, is
    no other's: the lock names its job by the rendezvous address. (Planted: the lock asked on rank 0
    only.)"""
    from types import SimpleNamespace

    from megazero.commands.train import checked_config
    from megazero.errors import ConfigError
    from megazero.run_lock import RunDirLock
    from parallel.launch import LaunchEnv

    files = make_files(tmp_path_factory.mktemp("inputs"))
    live = tmp_path / "live"
    shutil.copytree(files["live"], live)
    holder = {**RunDirLock(live).record, "job": "node-a:29400/777"}  # this process: a live holder
    (live / "LOCK").write_text(json.dumps(holder))
    args = SimpleNamespace(overrides=_train(files, "--logging.run_dir", str(live), "--model.num_layers", "4")[1:],
                           check=False)
    first_of_node_1 = LaunchEnv(rank=1, world_size=2, local_rank=0, local_world_size=1)
    monkeypatch.setenv("MASTER_ADDR", "node-b")
    monkeypatch.setenv("MASTER_PORT", "29400")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "778")
    checked_config(args, first_of_node_1)  # no word of the live job's checkpoint, nor a verdict on its lock
    monkeypatch.setenv("MASTER_ADDR", "node-a")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "777")  # its own job's lock: the checks go on
    with pytest.raises(ConfigError) as checked:
        checked_config(args, first_of_node_1)
    assert "in use" not in str(checked.value) and "num_layers" in str(checked.value), checked.value
    with pytest.raises(ConfigError, match="run directory is in use by pid"):  # rank 0 takes the lock: any is another's
        checked_config(args, LaunchEnv(rank=0, world_size=2, local_rank=0, local_world_size=1))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_while_the_run_starts_or_ends_releases_the_locks(tmp_path_factory, tmp_path, monkeypatch,
                                                                       capsys, signum):
    """Outside the trainer's loop a stop signal's default action ended rank 0 on the spot, leaving the
    run and checkpoint locks: a requeued job on another host was refused for ten minutes. During the
    start-up it now stops in one line with the locks released; after a finished run it is ignored,
    and the run ends as finished. The handler found is a note here, where a process has the default
    action: planted (rank 0 keeping it), the start-up goes on and trains. (Planted too: no ignoring
    after the run, which then stops as lost.)"""
    from megazero import startup
    from megazero.cli import main

    noted = []
    note = signal.signal(signum, lambda got, frame: noted.append(got))
    previous = signal.getsignal(signum)
    try:
        _stopped_at_the_start_and_the_end(tmp_path_factory, tmp_path, monkeypatch, capsys, signum, startup, main)
        assert signal.getsignal(signum) == previous and noted == []  # put back as found; never reached it
    finally:
        signal.signal(signum, note)


def _stopped_at_the_start_and_the_end(tmp_path_factory, tmp_path, monkeypatch, capsys, signum, startup, main):
    files = make_files(tmp_path_factory.mktemp("inputs"))
    run = tmp_path / "run"
    args = _train(files, "--logging.run_dir", str(run))
    consistent = startup.verify_consistent
    monkeypatch.setattr(startup, "verify_consistent", lambda cfg: (os.kill(os.getpid(), signum), consistent(cfg)))
    assert main(args) == 128 + signum
    name = signal.Signals(signum).name
    assert capsys.readouterr().err.strip().splitlines() == [f"megazero train: stopped by {name}"]
    assert not list(run.rglob(LOCK_FILE)) and not list(run.rglob("step_*"))  # nothing trained, nothing saved

    monkeypatch.setattr(startup, "verify_consistent", consistent)
    destroy = startup.destroy_process_group
    monkeypatch.setattr(startup, "destroy_process_group", lambda: (os.kill(os.getpid(), signum), destroy()))
    assert main(args) == 0
    assert "megazero: finished at step" in capsys.readouterr().out
    assert not list(run.rglob(LOCK_FILE)) and list(run.rglob("step_*"))
