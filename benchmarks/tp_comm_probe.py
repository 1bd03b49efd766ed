"""How much of a sequence-parallel collective hides behind a matrix product, by transport.

Launch with two GPUs: ``torchrun --nproc_per_node 2 benchmarks/tp_comm_probe.py``. At the shapes of
one transformer block of the 1.3B GPT (micro-batch 8, sequence 2048, hidden 2048, tp 2), it times
with CUDA events (median of ``--iters`` after warm-up):

- each collective alone, through NCCL and through peer memory (``parallel.tensor_parallel.peer_memory``);
- a GEMM alone, and the same GEMM with the all-gather started just before it (how much each
  transport slows the GEMM, and how much of the collective is left over);
- each of the block's four sequence-parallel linears, forward and backward separately: overlapped
  with each transport, composed (collective and product in series), and the products alone (the
  floor).

Prints one JSON line per measurement (milliseconds). ``--lead-cycles`` queues a spin on the GPU
before each timed call, so a figure holds no host launch latency (a step whose host runs ahead never
sees it). ``--sm-carveout N`` has every GEMM of the process leave N multiprocessors free, through
cuBLASLt (torch's experimental carveout): whether collectives that wait for multiprocessors behind
the GEMMs then hide (BENCHMARKS.md, 2026-11-28: at 24 the overlapped modes hid a third of the
communication, while the GEMMs ran 17-24% longer). ``--host-time`` adds, for each linear in
each mode, the host's microseconds per call (median of 40, issued while a long spin holds the GPU,
so no call waits for room in the launch queue): what the operator costs a step whose host, not its
GPU, sets the pace.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from parallel import comm
from parallel.tensor_parallel.overlap import MODES, start_gather  # also registers the megazero:: ops
from parallel.weight_grad_takers import IN_BACKWARD

TRANSPORTS = {"nccl": "overlap", "peer_memory": "peer_memory"}  # the mode each transport's gather runs in


def timed(fn, iters: int, lead_cycles: int = 0, warmup: int = 5) -> float:
    """Median milliseconds of ``fn()`` on the current stream, all ranks in step before each call.

    With ``lead_cycles`` the GPU first spins that many clock cycles (about a millisecond per two
    million) before the start event, while the host issues ``fn``'s work behind it: the time is then
    the GPU's alone, as in a step whose host runs ahead, not the host's launch latency."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lead_cycles:
            torch.cuda._sleep(lead_cycles)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_us(fn, calls: int = 40) -> float:
    """Median microseconds the host takes to issue ``fn()``, with the GPU held busy by a spin queued
    first (about half a second), so the calls only queue work."""
    for _ in range(3):
        fn()
    dist.barrier()
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return round(statistics.median(times) * 1e6, 1)


def per_op(group, tp: int, h: int, n: int, dev, dt, iters: int, lead: int, emit, host: bool = False) -> None:
    """Each of a block's four linears, forward and backward op by op: overlapped with each transport,
    composed (the collective, then the product, in series) and the products alone; with ``host``
    also each mode's host time per call."""
    ops = torch.ops.megazero
    name = group.group_name
    shapes = {"qkv": ("column", 3 * h // tp), "fc1": ("column", 4 * h // tp),
              "proj": ("row", h // tp), "fc2": ("row", 4 * h // tp)}
    for layer, (kind, width) in shapes.items():
        if kind == "column":
            x = torch.randn(8, n // 8, h, device=dev, dtype=dt)
            w = torch.randn(width, h, device=dev, dtype=dt) * 0.02
            full = torch.empty(n * tp, h, device=dev, dtype=dt)
            grad_y = torch.randn(8, n * tp // 8, width, device=dev, dtype=dt)
            grad_full = torch.empty(n * tp, h, device=dev, dtype=dt)
            grad_x = torch.empty(n, h, device=dev, dtype=dt)
            cases = {
                "fwd products": lambda: torch.mm(full, w.t()),
                "fwd composed": lambda: (comm.all_gather_into(full, x.view(-1, h), group), torch.mm(full, w.t())),
                "bwd products": lambda: (torch.mm(grad_y.view(-1, width), w), grad_y.view(-1, width).t() @ full),
                "bwd composed": lambda: (torch.mm(grad_y.view(-1, width), w, out=grad_full),
                                         comm.reduce_scatter_into(grad_x.view(-1), grad_full.view(-1), group),
                                         grad_y.view(-1, width).t() @ full),
            }
            for mode in MODES:
                cases[f"fwd {mode}"] = lambda mode=mode: ops.sp_column_linear(x, w, None, name, mode, IN_BACKWARD)
                cases[f"bwd {mode}"] = lambda mode=mode: ops.sp_column_linear_backward(
                    grad_y, full, w, None, name, mode, IN_BACKWARD)
        else:
            x = torch.randn(8, n * tp // 8, width, device=dev, dtype=dt)
            w = torch.randn(h, width, device=dev, dtype=dt) * 0.02
            grad_y = torch.randn(8, n // 8, h, device=dev, dtype=dt)
            out_full = torch.empty(n * tp, h, device=dev, dtype=dt)
            out = torch.empty(n, h, device=dev, dtype=dt)
            grad_full = torch.empty(n * tp, h, device=dev, dtype=dt)
            cases = {
                "fwd products": lambda: torch.mm(x.view(-1, width), w.t()),
                "fwd composed": lambda: (torch.mm(x.view(-1, width), w.t(), out=out_full),
                                         comm.reduce_scatter_into(out.view(-1), out_full.view(-1), group)),
                "bwd products": lambda: (torch.mm(grad_full, w), grad_full.t() @ x.view(-1, width)),
                "bwd composed": lambda: (comm.all_gather_into(grad_full, grad_y.view(-1, h), group),
                                         torch.mm(grad_full, w), grad_full.t() @ x.view(-1, width)),
            }
            for mode in MODES:
                cases[f"fwd {mode}"] = lambda mode=mode: ops.sp_row_linear(x, w, name, mode, IN_BACKWARD)
                cases[f"bwd {mode}"] = lambda mode=mode: ops.sp_row_linear_backward(
                    grad_y, x, w, name, mode, IN_BACKWARD)
        for case, fn in cases.items():
            mode = case.split()[-1]
            extra = {"host_us": host_us(fn)} if host and mode in MODES else {}
            emit(what=f"{layer} ({kind}) {case}", ms=round(timed(fn, iters, lead), 4), **extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8 * 2048)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--lead-cycles", type=int, default=0,
                        help="GPU clock cycles to spin before each timed call, hiding the host's launch latency")
    parser.add_argument("--host-time", action="store_true",
                        help="also report the host's microseconds per call of each linear in each mode")
    parser.add_argument("--sm-carveout", type=int, default=0,
                        help="multiprocessors every GEMM leaves free (cuBLASLt; 0: none)")
    args = parser.parse_args()
    if args.sm_carveout:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        torch._C._set_sm_carveout_experimental(args.sm_carveout)
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    group, tp, h = dist.group.WORLD, dist.get_world_size(), args.hidden
    n = args.tokens // tp
    dev, dt = torch.device("cuda", rank), torch.bfloat16
    rows = torch.randn(n, h, device=dev, dtype=dt)
    full = torch.empty(n * tp, h, device=dev, dtype=dt)
    w_qkv = torch.randn(h, 3 * h // tp, device=dev, dtype=dt) * 0.02
    emit = (lambda **r: print(json.dumps(r), flush=True)) if rank == 0 else (lambda **r: None)

    gemm = lambda: torch.mm(full, w_qkv)  # noqa: E731 - the column product of all tokens
    emit(what="gemm alone", shape=[n * tp, h, 3 * h // tp], ms=timed(gemm, args.iters, args.lead_cycles))
    for transport in TRANSPORTS:
        def gather():
            work = start_gather(full, rows, group.group_name, TRANSPORTS[transport])
            work.wait()

        def gather_beside_gemm():
            work = start_gather(full, rows, group.group_name, TRANSPORTS[transport])
            torch.mm(rows, w_qkv)
            torch.mm(rows, w_qkv)
            work.wait()

        emit(what="all-gather alone", transport=transport, mib=full.numel() * 2 / 2**20,
             ms=timed(gather, args.iters, args.lead_cycles))
        emit(what="all-gather beside a GEMM of all tokens", transport=transport,
             ms=timed(gather_beside_gemm, args.iters, args.lead_cycles))

    per_op(group, tp, h, n, dev, dt, args.iters, args.lead_cycles, emit, args.host_time)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
