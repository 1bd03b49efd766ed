"""Bringing a validated config to life on this rank: process group, topology, consistency check.

This is each worker's start-up; the launcher that starts the workers is ``parallel.launch``."""

from __future__ import annotations

import faulthandler
import hashlib
import os
import signal
import sys
from pathlib import Path
from typing import Optional

import torch.distributed as dist
import yaml

from megazero.config import Config, save_config
from megazero.config.loader import config_to_dict
from megazero.config.validate import config_notes
from megazero.errors import UserError, raise_terminated, said_in_one_line
from megazero.run_lock import RunDirLock, run_locks
from parallel.launch import (EXIT_STOPPED, LaunchEnv, LaunchError, destroy_process_group, init_process_group, pick_device,
                             started_by_torchrun)
from parallel.topology import RankGrid, Topology

PACKAGES = ("megazero", "parallel", "models", "data_pipeline")


def initialize(cfg: Config, launch: LaunchEnv):
    """Start the process group and build the topology; returns (device, topology)."""
    device = pick_device(cfg.train.device, launch.local_rank)
    with said_in_one_line(LaunchError):
        init_process_group(launch, device, cfg.train.collective_timeout_s)
    p = cfg.parallel
    grid = RankGrid(tp=p.tp, pp=p.pp, dp=p.dp, order=p.order)
    topology = Topology(grid, ranks_per_node=launch.local_world_size, timeout_s=cfg.train.collective_timeout_s)
    if topology.rank == 0:
        print(f"megazero: {topology.describe()} ({device.type})", flush=True)
        for note in config_notes(cfg):
            print(f"megazero: note: {note}", flush=True)
    return device, topology


def record_config(cfg: Config) -> None:
    """Write the resolved config into the run directory, once the run has started (its checkpoint
    loaded): a launch that fails before that leaves the previous run's record in place."""
    path = os.path.join(cfg.logging.run_dir, "config.yaml")
    save_config(cfg, path)
    print(f"megazero: resolved config in {path}", flush=True)


def code_fingerprint() -> str:
    """A hash of the installed megazero sources: ranks running different code must not train together."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def verify_consistent(cfg: Config) -> None:
    """Every rank must run the same resolved config and the same code; say which ranks differ."""
    mine = (hashlib.sha256(yaml.safe_dump(config_to_dict(cfg)).encode()).hexdigest()[:16], code_fingerprint())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for what, k in (("config", 0), ("code version", 1)):
        odd = [r for r, fp in enumerate(everyone) if fp[k] != everyone[0][k]]
        if odd:
            raise UserError(f"ranks {odd} run a different {what} from rank 0; launch every rank with the same "
                            f"config file, overrides and megazero checkout", agreed=True)


def lock_directories(cfg: Config) -> list[RunDirLock]:
    """Rank 0's locks (``run_locks``), taken in turn; one that cannot be taken releases the others."""
    held: list[RunDirLock] = []
    try:
        for lock in run_locks(cfg.logging.run_dir, cfg.save_dir):
            held.append(lock.acquire())
    except BaseException:
        for lock in reversed(held):
            lock.release()
        raise
    return held


def _crash_output() -> int:
    """The descriptor the fault handler writes a crash's stacks to: ``sys.stderr``'s, or, where that
    stream has none (captured in memory by a test harness or a notebook), the process's own standard
    error, where a native crash's message goes anyway. The handler writes from a signal handler, so
    it takes a descriptor, never a Python stream (given one without, ``enable`` raised and no rank
    started)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no stream, or one without a descriptor
        return 2


def start_run(cfg: Config, launch: LaunchEnv, started: Optional[float] = None) -> int:
    """Lock the run and checkpoint directories (rank 0), start the process group and topology, check
    that every rank agrees, train; returns the exit status. ``started`` (``time.monotonic()``) is when
    the command began, from which ``train.max_wall_seconds`` counts (None: from building the trainer).

    A rank that dies in native code (a segmentation fault in a library) prints every thread's Python
    stack first: without it the launcher reports an exit code of -11 and nothing of where."""
    from megazero.trainer import WALL_CLOCK, Trainer

    faulthandler.enable(file=_crash_output(), all_threads=True)
    previous = {signum: signal.getsignal(signum) for signum in STOPS}
    locks: list[RunDirLock] = []
    finished = False
    try:
        if launch.rank == 0:  # until the trainer takes them: a stop must not leave the locks behind
            for signum in STOPS:
                signal.signal(signum, raise_terminated)
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)  # none between a lock's file and its record
            try:
                locks = lock_directories(cfg)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # one that came is raised now
        device, topology = initialize(cfg, launch)
        verify_consistent(cfg)
        trainer = Trainer(cfg, device, topology, started)
        if topology.rank == 0 and not trainer.done():  # a finished run's record stays what it trained with
            record_config(trainer.cfg)  # with what the checkpoint kept (its pipeline split): what trains
        state = trainer.train()
        finished = True
        if dist.get_rank() == 0:
            if state.stopped_by:
                print(f"megazero: {'stopped' if state.stopped_by == WALL_CLOCK else 'preempted'} at step "
                      f"{state.step} by {state.stopped_by}, saved to {state.saved_to}", flush=True)
            else:
                print(f"megazero: finished at step {state.step} ({state.consumed} samples, {state.skipped} "
                      "skipped)", flush=True)
    finally:
        for signum in STOPS:  # the clean-up runs whole (and a finished run is not made to look lost)
            signal.signal(signum, signal.SIG_IGN)
        for lock in reversed(locks):  # first: the group's end may wait on ranks, or be cut by a Ctrl-C
            lock.release()
        trainer = None  # its groups are freed with the process group (``destroy_process_group``)
        if dist.is_initialized():
            destroy_process_group()
        if not (finished and started_by_torchrun()):  # a finished worker keeps ignoring them until it exits
            _restore(previous)
    return EXIT_STOPPED if state.stopped_by else 0  # 75: a scheduler tells a stop with steps left from the end


STOPS = (signal.SIGTERM, signal.SIGUSR1)
"""The stop signals the trainer saves on (with SIGINT, which Python raises as KeyboardInterrupt
already). Outside its loop their default action ended rank 0 on the spot, leaving its run and
checkpoint locks, which another host's relaunch (a requeued job) must then wait out; so rank 0
raises them (``Terminated``) until the trainer takes over, and from the clean-up on every rank
ignores them: the locks are released and the group ended whole, and a run that finished and saved
is not cut short into a lost-looking one (a worker keeps ignoring them to its exit; a caller in
this process gets its handlers back)."""


def _restore(handlers: dict) -> None:
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
