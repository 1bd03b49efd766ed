"""The command line: every subcommand explains itself, and the launcher's environment is read right."""

import os
import signal
import subprocess
import sys
import time

import pytest

from megazero.cli import SUBCOMMANDS, build_parser
from parallel.launch import EXIT_STOPPED, read_launch_env


def test_top_level_help_lists_every_subcommand():
    proc = subprocess.run([sys.executable, "-m", "megazero.cli", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0
    for name in SUBCOMMANDS:
        assert name.replace("_", "-") in proc.stdout


@pytest.mark.parametrize("name", [n.replace("_", "-") for n in SUBCOMMANDS])
def test_each_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([name, "--help"])
    assert exit_info.value.code == 0
    assert len(capsys.readouterr().out.splitlines()) > 3


def test_torchrun_environment():
    env = {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size, launch.num_nodes) == (5, 16, 1, 4, 4)


def test_slurm_environment_without_torchrun():
    env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "8(x2)"}
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == (9, 16, 1, 8)


def test_slurm_ntasks_per_node_sizes_the_node():
    """``sbatch --ntasks-per-node 4`` sets SLURM_NTASKS_PER_NODE (and SLURM_TASKS_PER_NODE only on some
    versions): 8 tasks are then 2 nodes of 4, whose first ranks each report a node's errors."""
    env = {"SLURM_PROCID": "4", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "4"}
    launch = read_launch_env(env)
    assert (launch.local_world_size, launch.num_nodes) == (4, 2)


@pytest.mark.parametrize("tasks_per_node", ["4,4", "4(x2)", "4(x1),4"])
def test_slurm_tasks_per_node_read_whole(tasks_per_node):
    """SLURM_TASKS_PER_NODE is run-length coded, one item a run of nodes: equal counts are nodes of that size."""
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": tasks_per_node}
    assert read_launch_env(env).local_world_size == 4


@pytest.mark.parametrize("env, message", [
    # srun -N3 -n10: nodes of 4, 3 and 3 read as nodes of 4, and a tp group spanning two nodes passed the check
    ({"SLURM_TASKS_PER_NODE": "4,3(x2)"}, "environment variable SLURM_TASKS_PER_NODE='4,3(x2)': the nodes run "
     "different numbers of tasks (4, 3); launch the same number on every node (srun --ntasks-per-node)"),
    ({"SLURM_TASKS_PER_NODE": "4x2"}, "environment variable SLURM_TASKS_PER_NODE='4x2': expected SLURM's list of "
     "tasks per node, such as '8(x4)' or '4,4', of 1 or more each"),
    ({"SLURM_TASKS_PER_NODE": "0(x2)"}, "SLURM_TASKS_PER_NODE='0(x2)': expected SLURM's list"),
    # each was taken for one node of all 10 ranks
    ({"SLURM_NTASKS_PER_NODE": "abc"}, "environment variable SLURM_NTASKS_PER_NODE='abc': expected a whole number "
     "of 1 or more"),
    ({"SLURM_NTASKS_PER_NODE": "0"}, "SLURM_NTASKS_PER_NODE='0': expected a whole number of 1 or more"),
    ({"SLURM_NTASKS_PER_NODE": "4"}, "environment variables SLURM_NTASKS=10 and SLURM_NTASKS_PER_NODE=4: the ranks "
     "do not fill whole nodes; launch the same number of ranks on every node"),
    ({"SLURM_NTASKS_PER_NODE": "5", "SLURM_LOCALID": "5"}, "environment variable SLURM_LOCALID=5: a local rank must "
     "be below the ranks per node (SLURM_NTASKS_PER_NODE=5)"),
])
def test_a_slurm_launch_of_uneven_or_unreadable_nodes_is_refused(env, message):
    from parallel.launch import LaunchError

    with pytest.raises(LaunchError) as refused:
        read_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "10", **env})
    assert message in str(refused.value) and "\n" not in str(refused.value), refused.value


@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"}, "environment variables WORLD_SIZE=6 and LOCAL_WORLD_SIZE=4: the "
     "ranks do not fill whole nodes; launch the same number of ranks on every node"),
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "4"}, "environment variable LOCAL_RANK=4: a local "
     "rank must be below the ranks per node (LOCAL_WORLD_SIZE=4)"),
])
def test_a_torchrun_launch_of_uneven_nodes_is_refused(env, message):
    """The tp-within-node check and the start-up line count nodes of LOCAL_WORLD_SIZE ranks each."""
    from parallel.launch import LaunchError

    with pytest.raises(LaunchError) as refused:
        read_launch_env(env)
    assert str(refused.value) == message


def test_uneven_slurm_nodes_are_one_line_from_train(capsys, monkeypatch):
    """The reviewer's launch: ``train --check`` said the config was fine for tp groups within nodes."""
    from megazero.cli import main

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "10", "SLURM_TASKS_PER_NODE": "4,3(x2)"}.items():
        monkeypatch.setenv(name, value)
    demo = os.path.join(os.path.dirname(__file__), "..", "configs", "demo.yaml")
    assert main(["train", demo, "--check", "--parallel.pp", "1", "--train.global_batch_size", "40"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "SLURM_TASKS_PER_NODE='4,3(x2)'" in err[0], err


def test_no_launcher_is_a_world_of_one():
    launch = read_launch_env({})
    assert (launch.rank, launch.world_size, launch.local_world_size) == (0, 1, 1)


def test_world_size_alone_describes_a_launch_to_check():
    from parallel.launch import read_launch_env

    env = read_launch_env({"WORLD_SIZE": "32", "LOCAL_WORLD_SIZE": "8"})
    assert (env.rank, env.world_size, env.local_world_size, env.num_nodes) == (0, 32, 8, 4)


@pytest.mark.parametrize("env, name", [({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc'"), ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
                                       ({"WORLD_SIZE": "4", "RANK": "-1"}, "RANK='-1'"),
                                       ({"SLURM_PROCID": "x", "SLURM_NTASKS": "4"}, "SLURM_PROCID='x'"),
                                       ({"WORLD_SIZE": "4", "RANK": "4"}, "rank 4 of 4")])
def test_a_launch_variable_out_of_range_is_named(env, name):
    from parallel.launch import LaunchError

    with pytest.raises(LaunchError, match=name.replace("(", r"\(")):
        read_launch_env(env)


@pytest.mark.parametrize("env, message", [({}, "MASTER_ADDR/MASTER_PORT are not set"),
                                          ({"MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT is not set"),
                                          ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "http"}, "MASTER_PORT='http'")])
def test_a_multi_rank_launch_without_a_rendezvous_address_is_named(monkeypatch, env, message):
    """Two ranks under srun without MASTER_ADDR and MASTER_PORT exported, or with a port that is not a
    number: the error says what to export, not torch's own from inside its rendezvous (a traceback)."""
    import torch

    from parallel import launch

    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launch.dist, "is_initialized", lambda: False)
    with pytest.raises(launch.LaunchError, match=message):
        launch.init_process_group(launch.LaunchEnv(1, 2, 1, 2), torch.device("cpu"))


def test_cuda_ranks_talk_over_nccl_and_cpu_ranks_over_gloo():
    """The GPU tests start their ranks on NCCL themselves, not through the launcher: a run whose CUDA
    ranks got gloo would move every collective through host copies, or fail at the first reduce-scatter."""
    import torch

    from parallel.launch import backend_for

    assert (backend_for(torch.device("cuda", 0)), backend_for(torch.device("cpu"))) == ("nccl", "gloo")


def test_a_bad_launch_variable_is_one_line_from_train(capsys, monkeypatch):
    from megazero.cli import main

    monkeypatch.setenv("WORLD_SIZE", "abc")
    assert main(["train", "--train.device", "cpu", "--check"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "WORLD_SIZE='abc'" in err[0], err


def _megazero(*argv: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megazero.cli", *argv], stderr=subprocess.PIPE, text=True, **popen)


def test_a_reader_that_leaves_stops_the_command_quietly():
    """`megazero train --help-config | head` (or `megazero plan ... --json | head`): the reader closes
    the pipe, and the command stops as a Unix tool does on SIGPIPE, with status 141 and nothing on
    stderr (planted: a BrokenPipeError traceback)."""
    proc = _megazero("train", "--help-config", stdout=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == "", err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_standard_output_on_a_full_disk_is_one_line():
    """Output redirected to a full disk is an error in one line naming standard output, not a traceback
    (planted: OSError's traceback from print)."""
    with open("/dev/full", "w") as full:
        proc = _megazero("train", "--help-config", stdout=full)
        err = proc.stderr.read()
    assert proc.wait(timeout=120) == 2, err
    assert err.splitlines() == ["megazero train: error: standard output: cannot be written (No space left on "
                                "device); free space where it goes, or send it elsewhere"], err


def test_the_first_rank_of_each_node_reports_errors():
    """8 ranks at 4 a node are 2 nodes, so the second node's first rank reports the errors only its
    files cause (a launch whose last node holds fewer ranks is refused: WORLD_SIZE 6 at 4 a node)."""
    from megazero.commands.train import reports_errors

    first, second = (read_launch_env({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "RANK": rank, "LOCAL_RANK": local})
                     for rank, local in (("0", "0"), ("4", "0")))
    assert (second.num_nodes, reports_errors(first), reports_errors(second)) == (2, True, True)


def test_world_size_without_a_node_size_is_one_node():
    """``WORLD_SIZE 8 megazero train --check``: eight ranks of one node, whose tensor groups may span
    all eight, not eight nodes of one rank."""
    launch = read_launch_env({"WORLD_SIZE": "8"})
    assert (launch.rank, launch.local_world_size, launch.num_nodes) == (0, 8, 1)


def _small_run(tmp_path) -> list[str]:
    """A config of a small model over a small written shard: what ``megazero train`` takes."""
    import numpy as np

    from data_pipeline.indexed import IndexedDatasetWriter
    from tests.bad_input_files import VOCAB, _model

    prefix = str(tmp_path / "small_text_document")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(8):
            w.add_document(np.arange(1, VOCAB, dtype=np.uint16))
    return _model(prefix, str(tmp_path / "run"))


def _as_rank(monkeypatch, rank: str) -> None:
    for name, value in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)


def test_only_rank_0_prints_the_memory_estimate(tmp_path, capsys, monkeypatch):
    """Every rank runs the start-up checks, but the planner's estimate is one line of the launch, not
    one a rank."""
    from megazero.cli import main

    config = _small_run(tmp_path)
    printed = []
    for rank in ("0", "1"):
        _as_rank(monkeypatch, rank)
        assert main(["train", *config, "--check"]) == 0
        printed.append("planner memory estimate" in capsys.readouterr().out)
    assert printed == [True, False]


def test_an_agreed_error_is_printed_by_rank_0_alone(tmp_path, capsys, monkeypatch):
    """An error every rank raised alike (``UserError.agreed``) is rank 0's to print, and every rank
    still fails; an error of one rank's own is printed by that rank (planted: rank 1 printing the
    agreed line, or silent on its own error, or exiting 0; every error agreed unless said otherwise)."""
    import megazero.startup
    from megazero.cli import main
    from megazero.errors import UserError

    config = _small_run(tmp_path)
    seen = {}
    for agreed in (True, False):
        def start_run(cfg, launch, started=None, agreed=agreed):
            raise UserError(f"the line (agreed {agreed})", **({"agreed": True} if agreed else {}))  # else the default
        monkeypatch.setattr(megazero.startup, "start_run", start_run)
        for rank in ("0", "1"):
            _as_rank(monkeypatch, rank)
            code = main(["train", *config])
            seen[rank, agreed] = code, "the line" in capsys.readouterr().err
    assert seen == {("0", True): (2, True), ("1", True): (2, False), ("0", False): (2, True),
                    ("1", False): (2, True)}, seen


@pytest.mark.parametrize("codes, signum, status", [
    ((EXIT_STOPPED, -9), None, EXIT_STOPPED),  # one worker saved: a save ends with a barrier of all ranks
    ((2, 1), None, 2),  # a worker said in one line what to fix
    ((2,), signal.SIGTERM, 128 + signal.SIGTERM),  # stopped without a save: the signal's status, said once
    ((1,), None, None)])  # any other failure is torchrun's own, report and all
def test_the_launchers_status_follows_its_workers(monkeypatch, capsys, codes, signum, status):
    """``python -m parallel.launch`` turns its workers' exit statuses into one status of its own."""
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from parallel import launch

    def torchrun(argv):
        assert os.environ[launch.LAUNCHER_PID] == str(os.getpid())  # what the workers would inherit
        raise ChildFailedError("megazero", {rank: ProcessFailure(rank, 100 + rank, code, "")
                                            for rank, code in enumerate(codes)})

    monkeypatch.setattr(torch.distributed.run, "main", torchrun)
    monkeypatch.setattr(launch._StopForwarder, "install", lambda self: (setattr(self, "signum", signum), self)[1])
    if status is None:
        with pytest.raises(ChildFailedError):
            launch.main([])
        assert launch.LAUNCHER_PID not in os.environ  # this process goes on: it is no launcher of its own
        return
    assert launch.main([]) == status
    assert launch.LAUNCHER_PID not in os.environ
    err = capsys.readouterr().err
    said = "megazero: the workers stopped on SIGTERM without saving (exit statuses 2)\n" if signum else ""
    assert err == said, err


def test_a_rank_leaves_an_error_to_rank_0_but_not_for_ever(monkeypatch):
    """A rank whose checks failed exits quietly where rank 0 says the same; under torchrun it waits
    first (its exit had torchrun stop rank 0 before rank 0 said anything), and says the error itself
    once the wait runs out. Outside torchrun nothing stops rank 0, and it exits at once."""
    from megazero.commands import train
    from megazero.errors import UserError

    error = UserError("data.blend: missing")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert train._left_to_rank_0(error) == 2
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "7")
    monkeypatch.setattr(train, "REPORTER_WAIT_S", 0.01)
    with pytest.raises(UserError, match="data.blend: missing"):
        train._left_to_rank_0(error)


@pytest.fixture
def agent_store(monkeypatch):
    """A store served as torchrun's agent serves its workers one, with their variables set."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "7")
    yield store


@pytest.mark.parametrize("passed", [True, False])
def test_the_other_ranks_wait_for_rank_0s_verdict(agent_store, passed):
    import threading

    from parallel.launch import rank_0_checks, tell_checks

    threading.Timer(0.5, tell_checks, args=(0, passed)).start()
    started = time.monotonic()
    assert rank_0_checks(1) is passed
    assert time.monotonic() - started >= 0.45


def test_only_rank_0_tells_and_it_waits_for_no_one(agent_store):
    """Rank 0 returns at once with nothing to wait for; another rank's ``tell_checks`` sets nothing
    (its verdict would stand for rank 0's). (Planted: either rank test dropped.)"""
    from parallel.launch import CHECKS_KEY, rank_0_checks, tell_checks

    tell_checks(1, False)
    assert not agent_store.check([CHECKS_KEY])
    started = time.monotonic()
    assert rank_0_checks(0) is None and time.monotonic() - started < 5


def test_no_store_no_wait(monkeypatch):
    from parallel.launch import rank_0_checks, tell_checks

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    tell_checks(0, True)
    assert rank_0_checks(1) is None


def test_a_rank_says_an_error_rank_0_passed_at_once(agent_store, monkeypatch, capsys, tmp_path):
    """A rank whose checks failed where rank 0's passed would wait for rank 0 to say it, which rank 0
    never does: it says it itself, at once. (Planted: no look at rank 0's verdict.)"""
    from megazero.cli import main
    from megazero.commands import train
    from parallel.launch import tell_checks

    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(train, "REPORTER_WAIT_S", 60.0)
    tell_checks(0, True)
    started = time.monotonic()
    assert main(["train", "--train.device", "cpu", "--data.blend", f"[[1.0, {tmp_path / 'none'}]]"]) == 2
    assert time.monotonic() - started < 30
    assert f"{tmp_path / 'none'}.idx: no such file" in capsys.readouterr().err


def test_check_on_any_rank_says_what_is_wrong(monkeypatch, capsys, tmp_path):
    """``--check`` is its own launch: on a rank other than 0 (under srun, say) it said nothing and
    exited 2, as a training rank leaves the error to rank 0. (Planted: reports_errors alone.)"""
    from megazero.cli import main

    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert main(["train", "--check", "--train.device", "cpu", "--data.blend", f"[[1.0, {tmp_path / 'none'}]]"]) == 2
    assert f"{tmp_path / 'none'}.idx: no such file" in capsys.readouterr().err
