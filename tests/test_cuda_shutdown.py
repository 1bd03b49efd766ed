"""A run whose blocks replayed as CUDA graphs ends: the process group is destroyed without waiting for
ever on the NCCL collectives the graphs recorded (``parallel.launch.destroy_process_group``).

Each rank records a column-parallel linear in ``overlap`` mode (an NCCL all-gather inside a custom op)
as a CUDA graph through torch.compile's ``reduce-overhead`` mode, replays it, and then ends its
process group inside the measured function, so a hang shows as a rank that never returns.
(Skipped unless two CUDA devices are visible.)"""

from __future__ import annotations

import time

import pytest
import torch

from tests.distributed import run_world

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def _record_replay_destroy(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from parallel.launch import destroy_process_group
    from parallel.tensor_parallel.overlap import column_linear

    torch.manual_seed(0)
    x = torch.randn(2, 64, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    group = dist.group.WORLD
    linear = torch.compile(lambda t: column_linear(t, w, None, group, "overlap").sum(), mode="reduce-overhead")
    counts = []
    original = torch.cuda.CUDAGraph.replay

    def replay(graph):
        counts.append(1)
        return original(graph)

    torch.cuda.CUDAGraph.replay = replay
    try:
        for _ in range(4):
            torch.compiler.cudagraph_mark_step_begin()
            linear(x)
        torch.cuda.synchronize()
    finally:
        torch.cuda.CUDAGraph.replay = original
    start = time.monotonic()
    destroy_process_group()
    return {"replays": len(counts), "destroy_s": time.monotonic() - start}


def test_process_group_ends_after_cuda_graphs_recorded_nccl_collectives():
    for report in run_world(2, _record_replay_destroy, timeout=180, backend="nccl"):
        assert report["replays"] >= 2, report  # the collective really was recorded and replayed
        assert report["destroy_s"] < 60, report
