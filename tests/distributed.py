"""Run a function on a real multi-process world (gloo, or NCCL on GPUs) and bring each rank's result back.

Starting torch processes costs seconds, so a test module starts one world per size and runs all
its cases inside it (the function loops over cases and returns a dict of results), then plain
pytest tests assert on what came back. A rank that hangs fails the run after ``timeout`` seconds,
and every rank's Python stack is printed first, so the report says what each one was waiting on.
"""

from __future__ import annotations

import faulthandler
import os
import queue
import sys
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def _child(rank: int, world_size: int, init_file: str, results, fn: Callable, args: tuple, timeout: float,
           backend: str, environ: dict) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.clear()  # the caller's environment, not the one the fork server started with
    os.environ.update(environ)
    torch.set_num_threads(1)
    faulthandler.enable(file=sys.stderr, all_threads=True)  # a native crash shows every thread's stack
    faulthandler.dump_traceback_later(max(timeout - 10, 5), exit=False, file=sys.stderr)
    try:
        device = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = {"device_id": torch.device("cuda", rank)}
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout), **device)
        value = fn(rank, world_size, *args)
        results.put((rank, "ok", value))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
        if dist.is_initialized():
            dist.destroy_process_group()


PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx", "megazero.engine",
           "megazero.trainer", "pytest", "tests.distributed"]
"""What the fork server imports once for every rank. torch imports ``torch._dynamo`` lazily, and a
model built on the meta device reaches it through the reference implementations of its
initialisers: 2.5 s of a core in every rank of nearly every world (11 s of wall time for a world of
8 on two cores), and inductor's compiler 2.4 s more where a world compiles. A rank unpickles its
function by importing the test module, and so pytest."""


def _context(backend: str):
    """On a machine without CUDA, ranks forked from a server process that imported torch and the
    project once (multiprocessing's fork server, started on first use and kept for the session):
    spawned afresh, every rank imported torch again, about 11 s of two cores for a world of 8 (see
    ``PRELOAD``). The server is a fresh interpreter, so nothing of the test process (threads,
    process groups) is forked into the ranks. Where CUDA is available ranks are spawned: importing
    the project asks CUDA for its devices, after which torch refuses CUDA in a forked child."""
    if backend != "gloo" or torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_world(world_size: int, fn: Callable, *args: Any, timeout: float = 300.0, backend: str = "gloo") -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` ranks (gloo on CPU, or ``backend="nccl"``
    with rank r on GPU r); returns results by rank."""
    ctx = _context(backend)
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="megazero-dist-")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_child, args=(r, world_size, init_file, results, fn, args, timeout, backend,
                                                 dict(os.environ)),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[str, Any]] = {}
    try:
        import time

        deadline = time.monotonic() + timeout
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcome))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s "
                                   f"(their stacks are printed above on stderr)")
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
                outcome[rank] = (status, value)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outcome]
                if dead and all(p.exitcode not in (0, None) for r, p in enumerate(procs) if r in dead):
                    try:  # a result may still be in flight from a rank that just exited
                        rank, status, value = results.get(timeout=2.0)
                        outcome[rank] = (status, value)
                        continue
                    except queue.Empty:
                        raise RuntimeError(f"ranks {dead} died without a result "
                                           f"(exit codes {[procs[r].exitcode for r in dead]})") from None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
        if os.path.exists(init_file):
            os.unlink(init_file)
    errors = {r: v for r, (s, v) in outcome.items() if s == "error"}
    if errors:
        first = min(errors)
        raise RuntimeError(f"{len(errors)} of {world_size} ranks failed; rank {first}:\n{errors[first]}")
    return [outcome[r][1] for r in range(world_size)]
