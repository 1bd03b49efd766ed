"""Host time per micro-batch of the tensor-parallel path, measured where the device costs nothing.

A GPT with the real depth (24 blocks) but tiny widths (hidden 64, sequence 64, micro-batch 1), tp 2
with sequence parallelism and compiled blocks, forward and backward on gloo CPU ranks: the compute is
negligible, so the time is what each micro-batch costs the host (Python, compiled-graph calls and
their guards, collective launches). On GPUs that cost stays the same at any micro-batch size and
bounds the step once the GPU work per micro-batch is smaller (BENCHMARKS.md)::

    python -m torch.distributed.run --nproc_per_node 2 benchmarks/tp_host_overhead.py
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from models import GPT
from models.config import ModelConfig
from models.parallelize import compile_gpt, tensor_parallelize_gpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    group = dist.group.WORLD
    cfg = ModelConfig(num_layers=args.layers, hidden_size=64, num_heads=4, vocab_size=512, seq_length=64)
    model = GPT(cfg, vocab_multiple=128 * dist.get_world_size(), seed=0)
    tensor_parallelize_gpt(model, group, seed=0, sequence_parallel=True)
    compile_gpt(model, dist.get_world_size())
    ids = torch.randint(0, cfg.vocab_size, (1, cfg.seq_length))

    def micro_batch() -> None:
        model(ids, ids, reduction="sum").backward()

    for _ in range(5):  # compilation and warm-up
        micro_batch()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        micro_batch()
    dist.barrier()
    if dist.get_rank() == 0:
        ms = (time.perf_counter() - start) / args.steps * 1e3
        print(f'{{"layers": {args.layers}, "tp": {dist.get_world_size()}, "ms_per_micro_batch": {ms:.1f}}}')
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
