"""One job per run directory: a second job is refused naming the holder; stale locks are taken over."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from megazero.run_lock import LOCK_FILE, RunDirBusy, RunDirLock


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


def test_another_hosts_lock_is_stale_only_once_its_heartbeat_stops(tmp_path):
    foreign = {"host": "node-that-is-not-this-one", "pid": 1, "started": time.time()}
    (tmp_path / LOCK_FILE).write_text(json.dumps(foreign))
    with pytest.raises(RunDirBusy, match="node-that-is-not-this-one"):
        RunDirLock(tmp_path, stale_after_s=60).acquire()
    old = time.time() - 120
    os.utime(tmp_path / LOCK_FILE, (old, old))
    with RunDirLock(tmp_path, stale_after_s=60) as lock:
        assert lock.holder() == lock.record


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
