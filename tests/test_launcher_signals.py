"""Stop signals through the real launch script, and Ctrl-C in a worker.

* ``scripts/pretrain_gpt.sh`` on 2 gloo ranks: SIGUSR1, SIGTERM or SIGINT sent to the script (not to
  torchrun, not to the workers) makes every worker save, the script exit 75 after the one
  "preempted at step N by SIG, saved to DIR" line and no torchrun failure report, and leaves no
  process of the run behind.
* A stop while torchrun or the workers start stops them without a torchrun failure report.
* torchrun killed with SIGKILL: every worker notices and exits within seconds, each with a line.
* The demo samples the run directory it trained, and not after a preemption.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from megazero.checkpoint import verify_checkpoint
from megazero.config import load_config
from parallel.launch import EXIT_STOPPED
from tests.test_trainer import VOCAB, write_arithmetic_shard

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "pretrain_gpt.sh"
PREEMPTED = re.compile(r"^megazero: preempted at step (\d+) by (SIG\w+), saved to (\S+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    return tiny_config(tmp_path_factory.mktemp("signals"))


def tiny_config(root: Path) -> Path:
    """A two-layer model on arithmetic-progression documents that would train for 100000 steps."""
    prefix = write_arithmetic_shard(str(root / "arith_text_document"), 200)
    cfg = load_config(None, [
        "--model.preset", "gpt2", "--model.num_layers", "2", "--model.hidden_size", "32", "--model.num_heads", "4",
        "--model.vocab_size", str(VOCAB), "--model.seq_length", "32", "--train.micro_batch_size", "2",
        "--train.global_batch_size", "4", "--train.train_steps", "100000", "--train.device", "cpu",
        "--data.blend", f"[[1.0, {prefix}]]", "--data.split", "1", "--logging.log_interval", "1"])
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(dataclasses.asdict(cfg)))
    return path


def _start(config: Path, run_dir: Path, **extra_env: str) -> subprocess.Popen:
    """The script, as a user or a batch system starts it; the run dir names every process of the run."""
    env = dict(os.environ, CONFIG=str(config), NPROC_PER_NODE="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               **extra_env)
    return subprocess.Popen([str(SCRIPT), "--logging.run_dir", str(run_dir)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_for_training(proc: subprocess.Popen, run_dir: Path, steps: int = 2, timeout: float = 300) -> None:
    """Until rank 0 has logged ``steps`` steps: the training loop, and its signal handler, are running."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended before training:\n{proc.communicate()[0]}")
        time.sleep(0.1)
    pytest.fail(f"no {steps} steps logged in {timeout:.0f}s")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has stopped; only its parent is late
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _processes_of(run_dir: Path) -> list[int]:
    """Live processes whose command line names the run directory: the script, torchrun, the workers."""
    needle = str(run_dir).encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if needle in f.read() and _alive(int(entry)):
                        found.append(int(entry))
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                pass
    return found


def _children(pid: int) -> list[int]:
    pids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            pids += [int(c) for c in f.read().split()]
    return pids


def _launcher(script: subprocess.Popen):
    """The script's torchrun (``python -m parallel.launch``), once started, else None."""
    for pid in _children(script.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"parallel.launch" in f.read():
                    return pid
        except FileNotFoundError:  # the script's `sleep` between two looks at the launcher
            pass
    return None


@pytest.fixture
def run_dir(tmp_path):
    """A unique run directory; whatever still runs under it afterwards is killed."""
    yield tmp_path / "run"
    stop_leftovers(tmp_path / "run")


def stop_leftovers(run_dir: Path) -> None:
    for pid in _processes_of(run_dir):
        os.kill(pid, signal.SIGKILL)


def _assert_preempted_and_saved(proc: subprocess.Popen, signum: int) -> None:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_STOPPED, out
    lines = PREEMPTED.findall(out)
    assert len(lines) == 1, out
    step, name, saved_to = lines[0]
    assert name == signal.Signals(signum).name
    manifest = verify_checkpoint(saved_to)  # complete, every file's checksum right
    assert manifest["step"] == int(step)
    assert {entry["rank"] for entry in manifest["files"].values()} == {0, 1}, "a worker did not save"
    assert "Traceback" not in out and "FAILED" not in out and "exitcode" not in out, out


def _check_signal_to_script(config, run_dir, signum):
    proc = _start(config, run_dir)
    _wait_for_training(proc, run_dir)
    proc.send_signal(signum)  # the script only: torchrun and the workers run in sessions of their own
    _assert_preempted_and_saved(proc, signum)
    assert _processes_of(run_dir) == []


def test_sigusr1_to_the_script_saves_on_every_worker_and_exits_75(config, run_dir):
    _check_signal_to_script(config, run_dir, signal.SIGUSR1)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_and_ctrl_c_to_the_script_save_on_every_worker_and_exit_75(config, run_dir, signum):
    _check_signal_to_script(config, run_dir, signum)


@pytest.mark.slow
def test_ctrl_c_while_the_workers_start_stops_them_without_a_failure_report(config, run_dir):
    proc = _start(config, run_dir)
    deadline = time.monotonic() + 300  # torch imports slowly on a loaded machine
    launcher = None
    while launcher is None or len(_children(launcher)) < 2:  # workers started, still far from their first step
        assert time.monotonic() < deadline and proc.poll() is None, "the workers did not start"
        launcher = _launcher(proc)
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, out
    assert "megazero: the workers stopped on SIGINT without saving" in out, out
    assert "exitcode" not in out, out  # no torchrun failure report
    assert not (run_dir / "checkpoints").exists() and _processes_of(run_dir) == []


def _catches(pid: int, signum: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(caught >> (signum - 1) & 1)


@pytest.mark.slow
def test_sigterm_at_the_rendezvous_stops_without_a_failure_report(config, run_dir):
    proc = _start(config, run_dir)
    deadline = time.monotonic() + 300  # torch imports slowly on a loaded machine
    launcher = None
    while launcher is None or not _catches(launcher, signal.SIGTERM):  # torchrun is up, no worker yet
        assert time.monotonic() < deadline and proc.poll() is None, "torchrun did not start"
        launcher = _launcher(proc)
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "exitcode" not in out and _processes_of(run_dir) == [], out


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_as_the_launcher_starts_is_held_until_it_can_take_it(config, run_dir, signum):
    """The script passed a signal on as soon as the launcher was forked, seconds before the launcher
    put in its handlers (it imports torch first): a SIGINT, ignored by a background job until then,
    was lost and the run trained to its end with status 0; a SIGTERM killed the launcher without a
    word. (Planted: the script passing the signal on at once.)"""
    proc = _start(config, run_dir)
    deadline = time.monotonic() + 300
    while (launcher := _launcher(proc)) is None:
        assert time.monotonic() < deadline and proc.poll() is None, "the launcher did not start"
        time.sleep(0.005)
    assert not _catches(launcher, signum)  # it cannot take the signal yet
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signum, out
    name = signal.Signals(signum).name  # the launcher may have started the workers by the time it takes it
    assert (f"megazero: {name} before the workers started; nothing to save" in out
            or f"megazero: the workers stopped on {name} without saving" in out), out
    assert "exitcode" not in out and "Traceback" not in out, out
    assert not (run_dir / "checkpoints").exists() and _processes_of(run_dir) == []


def test_an_input_error_through_the_script_is_one_line(config, tmp_path):
    """A bad input is the workers' one line and status 2; torchrun's notes on the worker that failed
    and on stopping the others followed it, reading as a crash. (Planted: no filter on those notes.)"""
    env = dict(os.environ, CONFIG=str(config), NPROC_PER_NODE="2", OMP_NUM_THREADS="1")
    done = subprocess.run([str(SCRIPT), "--logging.run_dir", str(tmp_path / "run"), "--data.blend",
                           f"[[1.0, {tmp_path / 'nothing'}]]"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"megazero train: error: data.blend: {tmp_path / 'nothing'}.idx: no "
                                                f"such file (expected a .bin/.idx pair for prefix "
                                                f"'{tmp_path / 'nothing'}'; write one with `megazero preprocess`)"]


SLOW_RANK_0 = """
import os, time
if os.environ.get("RANK") == "0":
    import megazero.preflight as preflight
    scan = preflight._largest_token_id
    preflight._largest_token_id = lambda *args: (time.sleep(3), scan(*args))[1]
"""


def test_an_input_error_is_said_even_where_rank_0_checks_longer(config, tmp_path):
    """Every rank finds a bad tokenizer path, but rank 0 also scans the data first: rank 1 exited at
    once, the launcher stopped rank 0 a tenth of a second later, and nothing was said. The other
    ranks now wait for rank 0 to say it. (Planted: no wait.)"""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_RANK_0)
    env = dict(os.environ, CONFIG=str(config), NPROC_PER_NODE="2", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(REPO)]))
    done = subprocess.run([str(SCRIPT), "--logging.run_dir", str(tmp_path / "run"), "--data.tokenizer",
                           str(tmp_path / "none.model")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("megazero train: error: data.tokenizer:") and "none.model" in line, line


def test_killing_torchrun_stops_every_worker(config, run_dir):
    proc = _start(config, run_dir)
    _wait_for_training(proc, run_dir)
    launcher = _launcher(proc)
    workers = _children(launcher)
    assert len(workers) == 2
    os.kill(launcher, signal.SIGKILL)
    killed = time.monotonic()
    out, _ = proc.communicate(timeout=60)  # the workers hold the output pipe too: it closes as they exit
    while any(_alive(pid) for pid in workers) and time.monotonic() - killed < 10:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers), f"workers outlived torchrun by 10 s:\n{out}"
    assert _processes_of(run_dir) == []
    assert proc.returncode == 128 + signal.SIGKILL, out
    assert out.count(f"its launcher (pid {launcher}) is gone; stopping without saving") == 2, out


@pytest.mark.slow
def test_demo_samples_the_run_it_trained_and_not_after_a_preemption(tmp_path):
    """The demo (no CONFIG) in a copy of the project's layout, with a run dir of its own."""
    root = tmp_path / "project"
    (root / "scripts").mkdir(parents=True)
    (root / "configs").mkdir()
    (root / "scripts" / SCRIPT.name).write_bytes(SCRIPT.read_bytes())
    (root / "scripts" / SCRIPT.name).chmod(0o755)
    (root / "configs" / "demo.yaml").write_bytes((REPO / "configs" / "demo.yaml").read_bytes())
    env = {k: v for k, v in os.environ.items() if k != "CONFIG"}
    env.update(CPU_RANKS="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    small = ["--parallel.tp", "1", "--parallel.pp", "1", "--logging.log_interval", "1"]

    def demo(run_dir: Path, steps: int) -> subprocess.Popen:
        return subprocess.Popen([str(root / "scripts" / SCRIPT.name), *small, "--train.train_steps", str(steps),
                                 "--logging.run_dir", str(run_dir)], cwd=root, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    finished = demo(tmp_path / "finished", 2)
    out, _ = finished.communicate(timeout=600)
    assert finished.returncode == 0, out
    assert f"== a sample from the trained model ({tmp_path / 'finished' / 'checkpoints'})" in out, out
    assert not (root / "runs").exists()

    preempted = demo(tmp_path / "preempted", 100000)
    try:
        _wait_for_training(preempted, tmp_path / "preempted")
        preempted.send_signal(signal.SIGTERM)
        out, _ = preempted.communicate(timeout=300)
    finally:
        for pid in _processes_of(tmp_path / "preempted"):
            os.kill(pid, signal.SIGKILL)
    assert preempted.returncode == EXIT_STOPPED, out
    assert len(PREEMPTED.findall(out)) == 1 and "a sample from" not in out, out


# --- Ctrl-C in one process ----------------------------------------------------------------------


@pytest.mark.parametrize("knobs, message", [
    ({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE must be a whole number from 1, got '0'"),
    ({"NPROC_PER_NODE": "abc"}, "NPROC_PER_NODE must be a whole number from 1, got 'abc'"),
    ({"CPU_RANKS": "2x"}, "CPU_RANKS must be a whole number from 1, got '2x'"),
    ({"NNODES": "two"}, "NNODES must be a whole number from 1, got 'two'"),
    ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK must be a whole number from 0 to 1, got '2'"),
    ({"NNODES": "2", "MASTER_PORT": "99999"}, "MASTER_PORT must be a whole number from 1 to 65535, got '99999'"),
    # each node hosted a rendezvous of its own on localhost, waited 10 minutes, then printed a traceback
    ({"NNODES": "2"}, "NNODES 2 needs MASTER_ADDR, the address of the node of NODE_RANK 0, on every node (under "
                      "SLURM it is found from SLURM_JOB_NODELIST)"),
    ({"CONFIG": "configs/nope.yaml"}, "CONFIG configs/nope.yaml: no such file (a relative path is read from the "
                                      "current folder, then from the repository); give a YAML config such as "
                                      "configs/gpt_1.3b.yaml"),
])
def test_a_bad_knob_is_one_line_before_anything_starts(tmp_path, knobs, message):
    """torchrun met these with a traceback (or, for a port, the script said it was in use)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "SLURM_JOB_NODELIST")}
    env.update({"CONFIG": "configs/demo.yaml", **knobs})
    done = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == f"pretrain_gpt.sh: error: {message}", done.stderr
    assert "== training" not in done.stdout


def test_one_node_under_slurm_looks_up_no_master_addr(tmp_path, monkeypatch):
    """NNODES 1 runs torchrun --standalone and needs no rendezvous host: inside a SLURM job, in a
    container without scontrol, the script died of "scontrol: command not found" (status 127) looking
    one up. (scontrol stands in, failing as a missing one does; planted: the lookup for any NNODES.)"""
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "scontrol").write_text("#!/usr/bin/env bash\necho 'scontrol: command not found' >&2\nexit 127\n")
    (missing / "scontrol").chmod(0o755)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    for name, value in {"PATH": f"{missing}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[1-2]",
                        "SLURM_NNODES": "1", "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(name, value)
    _, args = _launched(_on_eight_gpus(tmp_path / "run", "configs/gpt_1.3b.yaml", ["--check"]))
    assert "--standalone" in args and "--master_addr" not in args, args


def test_several_nodes_without_scontrol_ask_for_master_addr(tmp_path):
    """NNODES 2 under SLURM with no scontrol to read SLURM_JOB_NODELIST: the script's own line asking for
    MASTER_ADDR, not bash's "scontrol: command not found" (status 127)."""
    tools = tmp_path / "tools"  # what the script runs before the lookup; no scontrol among them
    tools.mkdir()
    for tool in ("dirname", "basename"):
        (tools / tool).symlink_to(shutil.which(tool))
    env = {"PATH": str(tools), "CONFIG": "configs/demo.yaml", "NNODES": "2", "SLURM_JOB_NODELIST": "node[1-2]"}
    done = subprocess.run([shutil.which("bash"), str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == (
        "pretrain_gpt.sh: error: NNODES 2 needs MASTER_ADDR, the address of the node of NODE_RANK 0, on every node, "
        "and scontrol is not here to find it from SLURM_JOB_NODELIST (a container?); export MASTER_ADDR"), done.stderr


def test_relative_paths_are_the_callers(config, tmp_path):
    """Started from another folder, the script ran the training in the repository, so a relative
    logging.run_dir (and every other relative path, CONFIG's included) was taken from there: the
    checkpoints went into the code's checkout, and the log named a folder the user did not have.
    (Planted: the script's old change of folder.)"""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(config, work / "cfg.yaml")
    env = dict(os.environ, CONFIG="cfg.yaml", NPROC_PER_NODE="1", OMP_NUM_THREADS="1")
    done = subprocess.run([str(SCRIPT), "--train.train_steps", "1", "--logging.run_dir", "runs/relative"], cwd=work,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (work / "runs" / "relative" / "checkpoints" / "step_0000001").is_dir()
    assert not (REPO / "runs" / "relative").exists()


def test_a_config_given_as_an_argument_is_one_line_naming_config():
    """The arguments are train's overrides: a config path among them was refused by every rank as an
    override (after the demo build, in the demo), without a word about CONFIG."""
    done = subprocess.run(["bash", str(SCRIPT), "configs/gpt_1.3b.yaml", "--train.train_steps", "5"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == (
        "pretrain_gpt.sh: error: unexpected argument 'configs/gpt_1.3b.yaml': arguments are overrides of megazero "
        f"train (--section.field VALUE); give a config file as CONFIG=configs/gpt_1.3b.yaml {SCRIPT}"), done.stderr
    assert "== " not in done.stdout


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["--train.seed", "3", "--help"]])
def test_help_lists_the_knobs_then_trains_options(tmp_path, args):
    """Also after overrides: there, the launch's own parse printed the help where the GPU count belonged,
    and torchrun's ranks printed it again."""
    done = subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Launch megazero pretraining with torchrun") and "NPROC_PER_NODE  ranks" in done.stdout
    assert "--check" in done.stdout and "== training" not in done.stdout


def test_help_config_lists_the_fields_once_without_a_launch():
    """Under torchrun every rank printed train's field list (the demo's 8 ranks, after its corpus build),
    then the demo sampled a checkpoint nothing had trained."""
    done = subprocess.run(["bash", str(SCRIPT), "--train.seed", "3", "--help-config"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("checkpoint.keep_last") == 1 and "== " not in done.stdout, done.stdout


SBATCH = REPO / "scripts" / "slurm_pretrain_gpt.sbatch"


def test_the_batch_script_finds_the_checkout_or_says_where_to_submit(tmp_path):
    """sbatch runs a spooled copy of the file from the submit folder: submitted from elsewhere, every
    node failed with "No such file" and the job ended for good. The checkout is MEGAZERO_HOME, else
    the submit folder, and a wrong one is one line. (srun stands in: it prints what it would run.)"""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\necho "$@"\n')
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho node1\n")
    (bin_dir / "sleep").write_text(f"#!/usr/bin/env bash\nexec {shutil.which('sleep')} 0.1\n")  # its 5 s slices
    for tool in ("srun", "scontrol", "sleep"):
        (bin_dir / tool).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node1", SLURM_JOB_ID="42",
               SLURM_SUBMIT_DIR=str(tmp_path))
    env.pop("MEGAZERO_HOME", None)
    done = subprocess.run(["bash", str(SBATCH)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip() == (
        f"slurm_pretrain_gpt.sbatch: error: {tmp_path}/scripts/pretrain_gpt.sh: no such file; submit from the "
        "megazero checkout, or set MEGAZERO_HOME to it"), done.stderr
    done = subprocess.run(["bash", str(SBATCH), "--train.seed", "3"], cwd=tmp_path,
                          env={**env, "MEGAZERO_HOME": str(REPO)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and f"{REPO}/scripts/pretrain_gpt.sh --train.seed 3" in done.stdout, done.stderr


@pytest.mark.parametrize("srun_status", [0, 75, 137])
def test_the_batch_script_requeues_after_the_warning_whatever_srun_says(tmp_path, srun_status):
    """SLURM's warning, then srun's status: the job comes back whatever it is. After the warning 0 is
    not taken for a finished run: a node killed by --kill-on-bad-exit as another exits 75 may end
    srun's status, and a run that did finish comes back only to say so. The script waits for srun in 5 s slices; a stand-in ``sleep``
    cuts each to 0.1 s, or every case waited out a slice after srun had gone."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sleep").write_text(f"#!/usr/bin/env bash\nexec {shutil.which('sleep')} 0.1\n")
    started = tmp_path / "srun_started"
    (bin_dir / "srun").write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        trap 'exit {srun_status}' USR1
        touch {started}
        while true; do sleep 0.1; done
        """))
    (bin_dir / "scontrol").write_text(f"#!/usr/bin/env bash\n[ \"$1\" = show ] && echo node1 || echo \"$@\" >> "
                                      f"{tmp_path / 'scontrol.log'}\n")
    for tool in ("srun", "scontrol", "sleep"):
        (bin_dir / tool).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node1", SLURM_JOB_ID="42")
    proc = subprocess.Popen(["bash", str(SBATCH)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 30
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    out = None
    while out is None and time.monotonic() < deadline:  # again until it lands past `step=$!` (a loaded machine)
        proc.send_signal(signal.SIGUSR1)  # the warning (#SBATCH --signal=B:USR1@300)
        try:
            out, _ = proc.communicate(timeout=2)
        except subprocess.TimeoutExpired:
            pass
    assert proc.returncode == srun_status, out
    log = tmp_path / "scontrol.log"
    assert log.read_text() == "requeue 42\n", out


def _on_eight_gpus(tmp_path, config, args, root=REPO, cpu_ranks=None, on_launch="") -> list[str]:
    """Run the script where torch says 8 GPUs; a stand-in for every other python records its
    arguments (the launcher's with its OMP_NUM_THREADS first) and the command lines it was given,
    running ``on_launch`` in place of the launcher. Returns those lines."""
    bin_dir, fake = tmp_path / "bin", tmp_path / "fake"
    bin_dir.mkdir(parents=True)
    fake.mkdir()
    (fake / "sitecustomize.py").write_text("import torch\ntorch.cuda.device_count = lambda: 8\n")
    seen = tmp_path / "python_calls"
    (bin_dir / "python").write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        case "$*" in
          *launch_facts*) PYTHONPATH={fake}:{REPO} exec {sys.executable} "$@" ;;
          *parallel.launch*) echo "${{OMP_NUM_THREADS:-unset}} $*" >> {seen}; {on_launch} ;;
          *) echo "$*" >> {seen} ;;
        esac
        """))
    (bin_dir / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CONFIG", "OMP_NUM_THREADS", "NPROC_PER_NODE")}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", **({"CONFIG": config} if config else {}),
               **({"CPU_RANKS": cpu_ranks} if cpu_ranks else {}))
    done = subprocess.run(["bash", str(root / "scripts" / SCRIPT.name), *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return seen.read_text().splitlines()


def _launched(calls: list[str]) -> tuple[str, str]:
    """(OMP_NUM_THREADS, the launcher's arguments) from ``_on_eight_gpus``' calls."""
    [launch] = [call for call in calls if "parallel.launch" in call]
    threads, args = launch.split(" ", 1)
    return threads, args


@pytest.mark.parametrize("config, overrides, threads", [(None, [], "1"), ("configs/gpt_1.3b.yaml", [], "unset"),
                                                       ("configs/gpt_1.3b.yaml", ["--train.device", "cpu"], "1")])
def test_cpu_ranks_run_one_thread_each_on_a_gpu_machine(tmp_path, config, overrides, threads):
    """On a machine with 8 GPUs the demo still trains 8 CPU ranks; their count matched the GPUs', so
    OMP_NUM_THREADS was left unset and each rank took every core. So did any config whose
    train.device is cpu (the demo's flag alone decided)."""
    given, args = _launched(_on_eight_gpus(tmp_path, config, overrides))
    assert given == threads and "--nproc_per_node 8" in args, args


def test_a_check_lays_out_the_ranks_the_run_would(tmp_path):
    """``--check`` goes to train, not to the config: the script took it for an override, the config
    failed to load, and a CPU config was checked on one rank per GPU (8, not CPU_RANKS 2)."""
    args = ["--train.device", "cpu", "--check"]
    given, launched = _launched(_on_eight_gpus(tmp_path, "configs/gpt_1.3b.yaml", args, cpu_ranks="2"))
    assert given == "1" and "--nproc_per_node 2" in launched and launched.endswith(" ".join(args)), launched


@pytest.mark.parametrize("args, facts", [
    ([], ["cpu", "train", "runs/demo/checkpoints", "data/demo/tokenizer.model"]),
    (["--checkpoint.save_dir", "ckpt", "--data.tokenizer", "tok.model", "--check"],
     ["cpu", "check", "ckpt", "tok.model"]),
    (["--model.layers", "zero"], ["auto", "train", "", ""]),
])
def test_the_launch_reads_the_device_action_checkpoints_and_tokenizer_train_will(args, facts):
    """The demo samples where the run saved: checkpoint.save_dir, where given, before the run dir's
    checkpoints, and the tokenizer the run read (planted: each left out). A config that does not
    load counts as device auto, not cpu: train names what is wrong, on the ranks the GPUs would take."""
    from megazero.commands.train import launch_facts

    assert launch_facts([str(REPO / "configs" / "demo.yaml"), *args])[1:] == facts


def test_the_demo_samples_the_checkpoints_it_launched_with(tmp_path):
    """The demo's sample comes from the config read at the launch: one edited while the run trained
    sent it to another run's checkpoints (planted: the config read again after training); and a
    ``--check`` trains nothing, so nothing is sampled (it read the config with --check as an override,
    a traceback)."""
    root = tmp_path / "project"
    (root / "scripts").mkdir(parents=True)
    (root / "configs").mkdir()
    (root / "scripts" / SCRIPT.name).write_bytes(SCRIPT.read_bytes())
    (root / "configs" / "demo.yaml").write_bytes((REPO / "configs" / "demo.yaml").read_bytes())
    edit = "sed -i s@runs/demo@runs/other@ configs/demo.yaml"
    calls = _on_eight_gpus(tmp_path / "trains", None, [], root=root, on_launch=edit)
    assert calls[-1].startswith("-m megazero.cli generate runs/demo/checkpoints --tokenizer "), calls
    (root / "configs" / "demo.yaml").write_bytes((REPO / "configs" / "demo.yaml").read_bytes())
    calls = _on_eight_gpus(tmp_path / "checks", None, ["--check"], root=root)
    assert not [call for call in calls if "generate" in call], calls
