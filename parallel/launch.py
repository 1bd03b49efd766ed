"""Both sides of the launcher: the workers' view of it, and the launcher itself.

Workers: torchrun sets RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE; under SLURM without torchrun the
same facts come from SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID/SLURM_NTASKS_PER_NODE (else
SLURM_TASKS_PER_NODE); every node must run the same number of ranks. With neither, the process is a
world of one, which still gets a (gloo, in-memory) process group so every code path is the same
whatever the world size. A worker started by torchrun exits when torchrun is gone.

Launcher: ``python -m parallel.launch [torchrun arguments]`` is torchrun with the stop signals
(SIGTERM, SIGUSR1, SIGINT) passed to the workers instead of handled by torchrun; see ``main``. The
workers start with those signals blocked, and ``megazero`` takes them once it can.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
import re
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from parallel.stop_signals import STOP_SIGNALS, started_by_torchrun


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int  # the same on every node: ``read_launch_env`` refuses a launch where it is not

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size


def _count(env: Mapping[str, str], name: str, default: Optional[int] = None, low: int = 0) -> int:
    """The whole number in variable ``name`` (``default`` where it is unset), refused below ``low``."""
    text = env.get(name)
    if text is None and default is not None:
        return default
    try:
        value = int(text)
    except (TypeError, ValueError):
        value = None
    if value is None or value < low:
        raise LaunchError(f"environment variable {name}={text!r}: expected a whole number of {low} or more")
    return value


_SLURM_NODE_COUNTS = re.compile(r"([1-9]\d*)(?:\(x[1-9]\d*\))?")  # one item of SLURM_TASKS_PER_NODE: "4", "3(x2)"


def _slurm_tasks_per_node(env: Mapping[str, str]) -> tuple[Optional[int], str]:
    """(tasks per node, the variable that said so) under srun; (None, "") where neither variable is set.

    SLURM_TASKS_PER_NODE lists every node's count, run-length coded ("4,3(x2)" from ``srun -N3 -n10``).
    Its first count alone was read: nodes of 4, 3 and 3 tasks passed for nodes of 4, and a tensor
    group checked to sit in a node spanned two. The ranks per node must be one number (the grid
    and the tp-within-node check assume it), so a list of different counts is refused."""
    if "SLURM_NTASKS_PER_NODE" in env:
        return _count(env, "SLURM_NTASKS_PER_NODE", low=1), "SLURM_NTASKS_PER_NODE"
    text = env.get("SLURM_TASKS_PER_NODE")
    if text is None:
        return None, ""
    items = [_SLURM_NODE_COUNTS.fullmatch(item) for item in text.split(",")]
    if not all(items):
        raise LaunchError(f"environment variable SLURM_TASKS_PER_NODE={text!r}: expected SLURM's list of tasks "
                          "per node, such as '8(x4)' or '4,4', of 1 or more each")
    counts = sorted({int(item.group(1)) for item in items}, reverse=True)
    if len(counts) > 1:
        raise LaunchError(f"environment variable SLURM_TASKS_PER_NODE={text!r}: the nodes run different numbers of "
                          f"tasks ({', '.join(map(str, counts))}); launch the same number on every node "
                          "(srun --ntasks-per-node)")
    return counts[0], "SLURM_TASKS_PER_NODE"


def read_launch_env(env: Mapping[str, str] = os.environ) -> LaunchEnv:
    """This process's place in the launch, from torchrun's or SLURM's variables (one process if
    neither is set); a variable that is not a count in range, or that disagrees with the others, is a
    ``LaunchError`` naming it."""
    if "WORLD_SIZE" in env:  # torchrun sets RANK too; WORLD_SIZE alone describes a launch to --check
        world = _count(env, "WORLD_SIZE", low=1)
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        launch = LaunchEnv(_count(env, "RANK", 0), world, _count(env, "LOCAL_RANK", 0),
                           _count(env, "LOCAL_WORLD_SIZE", world, low=1))
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = _count(env, "SLURM_NTASKS", low=1)
        per_node, per_node_name = _slurm_tasks_per_node(env)
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", per_node_name or "SLURM_NTASKS")
        launch = LaunchEnv(_count(env, "SLURM_PROCID"), world, _count(env, "SLURM_LOCALID", 0), per_node or world)
    else:
        return LaunchEnv(0, 1, 0, 1)
    _check_launch(launch, names)
    return launch


def _check_launch(launch: LaunchEnv, names: tuple[str, str, str, str]) -> None:
    """The counts agree with each other: ``names`` are the variables of rank, world size, local rank
    and ranks per node. Nodes of unequal size would pass the tp-within-node check on the first node's
    size while a tensor group spans two; a local rank past the node's size would pick another rank's GPU."""
    rank, world, local_rank, local_world = names
    if launch.rank >= launch.world_size:
        raise LaunchError(f"launch environment: rank {launch.rank} of {launch.world_size}: a rank must be below "
                          f"the world size ({rank}={launch.rank}, {world}={launch.world_size})")
    if launch.world_size % launch.local_world_size:
        raise LaunchError(f"environment variables {world}={launch.world_size} and {local_world}="
                          f"{launch.local_world_size}: the ranks do not fill whole nodes; launch the same number "
                          "of ranks on every node")
    if launch.local_rank >= launch.local_world_size:
        raise LaunchError(f"environment variable {local_rank}={launch.local_rank}: a local rank must be below "
                          f"the ranks per node ({local_world}={launch.local_world_size})")


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU tensors."""
    return "nccl" if device.type == "cuda" else "gloo"


DEVICES = ("auto", "cpu", "cuda")  # what a run may ask for (train.device); auto = cuda when visible


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("train.device is 'cuda' but no CUDA device is visible; use --train.device cpu")
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def init_process_group(launch: LaunchEnv, device: torch.device, timeout_s: float = 600.0) -> None:
    """Start the default group; a world of one uses an in-memory store and needs no rendezvous.

    Under torchrun the rank first ties its life to torchrun's (``exit_with_launcher``), before the
    rendezvous, the first place an orphaned rank would wait.
    """
    if dist.is_initialized():
        return
    if started_by_torchrun():
        exit_with_launcher(launch.rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = backend_for(device)
    if launch.world_size == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    _check_rendezvous_env(os.environ)
    try:
        dist.init_process_group(backend, rank=launch.rank, world_size=launch.world_size, timeout=timeout)
    except dist.DistNetworkError as exc:
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        if "EADDRINUSE" in str(exc):
            raise LaunchError(f"rank {launch.rank}: MASTER_PORT {where} is already in use on this host (another "
                              "job?); set MASTER_PORT to a free port") from None
        raise LaunchError(f"rank {launch.rank}: cannot reach the rendezvous at {where} "
                          f"({str(exc).splitlines()[0]}); check MASTER_ADDR and MASTER_PORT") from None


def _check_rendezvous_env(env: Mapping[str, str]) -> None:
    """The rendezvous address a multi-rank start needs, both halves of it: torch's own errors for a
    missing or malformed one are tracebacks from inside its rendezvous (torch has no default port)."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in env]
    if missing:
        raise LaunchError(f"{'/'.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: start multi-rank "
                          "runs with torchrun (scripts/pretrain_gpt.sh does) or export MASTER_ADDR and "
                          "MASTER_PORT under srun")
    port = env["MASTER_PORT"]
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        raise LaunchError(f"environment variable MASTER_PORT={port!r}: expected a port number from 1 to 65535")


def destroy_process_group() -> None:
    """End every group, after dropping torch.compile's recorded CUDA graphs, and free them now.

    NCCL cannot destroy a communicator while a CUDA graph that recorded one of its collectives is
    alive (a block replayed as a graph records its tensor-parallel collectives): the destroy waits
    for ever (pytorch issue 115388), and a run that finished would hold its nodes until the
    scheduler's time limit. torch keeps the recorded graphs in per-thread trees beside its compile
    caches, so both are cleared and the graphs collected first.

    The groups' objects are then collected while the interpreter is whole: objects that still hold a
    group (a trainer, in a reference cycle) were otherwise freed, if at all, as the interpreter shut
    down. Twice a rank that had saved and finished aborted at exit ("terminate called without an
    active exception", status -6), the mark of native threads still running at shutdown; freeing the
    groups here is meant to rule that out (the abort was not reproduced on demand)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        torch._dynamo.reset()
        reset_cudagraph_trees()
        gc.collect()
    dist.destroy_process_group()
    gc.collect()


class LaunchError(RuntimeError):
    """The launch environment is wrong (rendezvous address, port); the message says what to set."""


# --- rank 0's start-up checks, told through torchrun's store ---------------------------------------

CHECKS_KEY = "megazero/rank-0-checks"  # torchrun makes a new store for each start of its workers
CHECKS_PASSED, CHECKS_FAILED = b"passed", b"failed"
CHECKS_POLL_S = 0.2
STORE_TIMEOUT_S = 300.0  # for one request to a store that is already up


def tell_checks(rank: int, passed: bool) -> None:
    """Rank 0's verdict on its start-up checks, for ``rank_0_checks`` on the other ranks (a no-op on those)."""
    store = _agent_store() if rank == 0 else None
    if store is not None:
        store.set(CHECKS_KEY, CHECKS_PASSED if passed else CHECKS_FAILED)


def rank_0_checks(rank: int) -> Optional[bool]:
    """Whether rank 0's start-up checks passed, once it knows; None on rank 0 itself, and where
    torchrun serves no store.

    Rank 0 alone scans the data before any process group exists (every shard's largest token id,
    cached after the first start). The other ranks went straight on to the rendezvous, where they
    wait ``train.collective_timeout_s`` at most: a first start on a large corpus outlasted that, and
    they failed with a store timeout naming neither rank 0 nor the scan. They now wait here for as
    long as rank 0 takes, which torchrun bounds: it ends them if rank 0 dies, and they end with it."""
    store = _agent_store() if rank != 0 else None
    if store is None:
        return None
    exit_with_launcher(rank)
    try:
        while not store.check([CHECKS_KEY]):
            time.sleep(CHECKS_POLL_S)
        return store.get(CHECKS_KEY) == CHECKS_PASSED
    except (RuntimeError, dist.DistError) as exc:  # the store's host (rank 0's node) is gone
        raise LaunchError(f"rank {rank}: lost torchrun's store at {_store_address()} while rank 0 checked the "
                          f"run ({str(exc).splitlines()[0]}); see rank 0's node") from None


def _agent_store() -> Optional[dist.TCPStore]:
    """A client of the store torchrun's agent serves before it starts any worker (None without one)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host, port = _store_address().rsplit(":", 1)
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
    except (RuntimeError, dist.DistError) as exc:
        raise LaunchError(f"cannot reach torchrun's store at {_store_address()} ({str(exc).splitlines()[0]})") from None


def _store_address() -> str:
    return f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"


# --- a worker ends with its launcher ------------------------------------------------------------

EXIT_ORPHANED = 1


def exit_with_launcher(rank: int, poll_s: float = 1.0) -> None:
    """End this process, with one line, as soon as the process that started it (torchrun) is gone.

    torchrun starts each worker in a Unix session of its own, so a torchrun killed with SIGKILL (by
    a person, the OOM killer, a scheduler) takes no worker with it: they would train on unsupervised,
    and a relaunch beside them would wait in its first collective for the whole timeout. Saving needs
    every rank, and the ranks on other nodes are being stopped by their own launchers, so the worker
    only exits. A daemon thread waits on a pidfd of the parent, which wakes it the moment the parent
    exits (every rank at once, before a dying peer breaks their collectives); where pidfds are missing
    it polls ``getppid`` every ``poll_s`` seconds.
    """
    global _launcher_watch
    if _launcher_watch is None:  # else watched since an earlier wait (rank 0's checks, then the rendezvous)
        _launcher_watch = threading.Thread(target=_exit_when_gone, args=(launcher_pid(), rank, poll_s),
                                           name="launcher-watch", daemon=True)
        _launcher_watch.start()


_launcher_watch: Optional[threading.Thread] = None
LAUNCHER_PID = "MEGAZERO_LAUNCHER_PID"
"""Set by ``main`` for its workers: the launcher they must end with. A worker whose launcher stopped
while it was starting (a Ctrl-C as torchrun spawned it) had been handed to init before it began
watching, watched init instead, and waited at the rendezvous of a store that was gone, holding the
launch's output open for its whole timeout."""


@contextlib.contextmanager
def _named_to_workers():
    """This process named in ``LAUNCHER_PID`` for the workers torchrun starts meanwhile (they inherit
    the environment); restored after, so a process that calls ``main`` and goes on (a test) does not
    take itself for its own launcher and end at its next watch."""
    before = os.environ.get(LAUNCHER_PID)
    os.environ[LAUNCHER_PID] = str(os.getpid())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LAUNCHER_PID, None)
        else:
            os.environ[LAUNCHER_PID] = before


def launcher_pid() -> int:
    """The process this worker ends with: the one ``LAUNCHER_PID`` names, else its parent (a worker
    of plain torchrun)."""
    try:
        return int(os.environ[LAUNCHER_PID])
    except (KeyError, ValueError):
        return os.getppid()


def _exit_when_gone(parent: int, rank: int, poll_s: float) -> None:
    try:
        with os.fdopen(os.pidfd_open(parent), "rb", buffering=0) as pidfd:
            if os.getppid() == parent:  # else it died (and its pid may be reused) before the pidfd opened
                select.select([pidfd], [], [])  # readable once the process has exited
    except (AttributeError, OSError):  # no pidfd_open (Python < 3.9, Linux < 5.3), or the parent is gone
        while os.getppid() == parent:
            time.sleep(poll_s)
    os.write(2, f"megazero: rank {rank}: its launcher (pid {parent}) is gone; stopping without saving (a "
                "relaunch resumes from the last checkpoint)\n".encode())
    os._exit(EXIT_ORPHANED)


# --- the launcher: torchrun, with the stop signals passed to the workers --------------------------

EXIT_STOPPED = os.EX_TEMPFAIL  # 75: what a worker exits with once it has saved and stopped on a signal
EXIT_USAGE = 2  # what a worker exits with after printing an error the user can fix (bad config, data, input)


class _StopForwarder:
    """Passes each stop signal on to torchrun's workers, which it has torchrun start with those
    signals blocked: ``megazero`` unblocks them once it can take them. One forwarded while a
    worker's interpreter was still starting cut it short, a SIGINT with a fatal-error traceback from
    its ``site`` import; now it waits, pending, and is taken at the unblock."""

    def __init__(self):
        self.signum: Optional[int] = None  # the first stop signal received
        self.forwarded = False
        self.workers: list = []  # every worker torchrun started (``subprocess.Popen``)

    def install(self) -> "_StopForwarder":
        from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import (
            SubprocessHandler)

        for signum in STOP_SIGNALS:
            signal.signal(signum, self._forward)
        popen = SubprocessHandler._popen

        def popen_held(handler, *args, **kwargs):  # the mask passes through fork and exec
            previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            try:
                worker = popen(handler, *args, **kwargs)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)
            self.workers.append(worker)
            return worker

        SubprocessHandler._popen = popen_held
        return self

    def finished(self) -> bool:
        """Whether workers were started and every one has exited with status 0."""
        return bool(self.workers) and all(worker.poll() == 0 for worker in self.workers)

    def _forward(self, signum, frame) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if self.signum is None:
            self.signum = signum
            # From here torchrun's notes on workers it stops or sees exit read as failures: the
            # workers' own lines say what happened.
            logging.disable(logging.ERROR)
        workers = [worker.pid for worker in self.workers if worker.returncode is None]
        if not workers and not self.forwarded:  # at the rendezvous, or at the exit barrier: nothing to save
            raise SignalException(f"{signal.Signals(signum).name} with no worker running",
                                  sigval=signal.Signals(signum))
        for pid in workers:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        self.forwarded = True


class _QuietOwnStatuses(logging.Filter):
    """Drops torchrun's notes on workers that end with a status this launcher says in its workers' own
    line (2: an input the user must fix; 75: saved and stopped), and its note that it stops the
    other workers: under a one-line error they read as a crash. Any other failure keeps its report."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "Sending process %s closing signal %s":
            return False
        if str(record.msg).startswith("failed (exitcode: %s)") and isinstance(record.args, tuple) and record.args:
            return record.args[0] not in (EXIT_USAGE, EXIT_STOPPED)
        return True


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m parallel.launch [torchrun arguments]``: torchrun, except for SIGTERM/SIGUSR1/SIGINT.

    torchrun handles a stop signal by passing it to the workers and killing them 30 s later, saved or
    not, then exits with a traceback; SIGUSR1 (SLURM's warning) it does not handle at all, so it dies
    and orphans the workers. Here each of these signals goes to every worker and torchrun keeps
    waiting. Workers that saved and stopped exit with 75 (EX_TEMPFAIL, "try again later"), which
    torchrun reports as a failure with a long report; when any worker of this node exits 75 the
    checkpoint is complete (a save ends with a barrier of all ranks), so 75 is this process's status,
    without the report. When no worker saved after a stop signal (it came while they were starting
    up, or a second Ctrl-C followed), the status is 128 + the signal, after one line; the workers'
    own output says why; after this node's workers finished (torchrun waits for the other nodes'
    there) it is 0, after one line. A worker that exits 2 has printed what the user must fix, in one line: 2 is
    the status, without the report. Any other failure is torchrun's, report and all.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    stop = _StopForwarder().install()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_QuietOwnStatuses())
    try:
        with _named_to_workers():
            torchrun(["--signals-to-handle", "SIGHUP,SIGQUIT", *(sys.argv[1:] if argv is None else argv)])
    except SignalException as e:
        if e.sigval not in STOP_SIGNALS:  # SIGHUP, SIGQUIT: torchrun's own shutdown
            raise
        if stop.finished():  # torchrun waited for other nodes' workers to finish (its exit barrier)
            print(f"megazero: {e.sigval.name} after this node's workers finished; nothing to save", file=sys.stderr)
            return 0
        if stop.workers:  # they failed, and torchrun was about to say so
            statuses = ", ".join(str(worker.poll()) for worker in stop.workers)
            print(f"megazero: {e.sigval.name} after the workers ended (exit statuses {statuses})", file=sys.stderr)
            return 128 + e.sigval
        print(f"megazero: {e.sigval.name} before the workers started; nothing to save", file=sys.stderr)
        return 128 + e.sigval
    except ChildFailedError as failed:
        codes = {failure.exitcode for failure in failed.failures.values()}
        if EXIT_STOPPED in codes:
            return EXIT_STOPPED
        if EXIT_USAGE in codes and stop.signum is None:  # a worker already said what to fix, in one line
            return EXIT_USAGE
        if stop.signum is None:
            raise
        statuses = ", ".join(str(code) for code in sorted(codes))
        print(f"megazero: the workers stopped on {signal.Signals(stop.signum).name} without saving (exit "
              f"statuses {statuses})", file=sys.stderr)
        return 128 + stop.signum
    return 0


if __name__ == "__main__":
    sys.exit(main())
