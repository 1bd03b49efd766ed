"""The pipeline-parallel peer: torch-native pipelines (``torch.distributed.pipelining``, the
torchtitan recipe) on the blocks of ``common.py``'s GPT, split evenly over the ranks of one node:
1F1B (one stage a rank), interleaved 1F1B (two stages a rank, round robin) and the zero-bubble
ZBV schedule (two stages a rank in a V). bf16 autocast, fused AdamW, ``--compile`` compiles each
block (ZBV refuses compiled stages in the torch versions measured). The head is untied (a tied
head would need its own gradient exchange between the first and last stage); FLOPs are counted as
for the tied model. Tokens/s are per GPU of the one replica the ranks hold together.

    torchrun --nproc-per-node 2 benchmarks/peers/pipeline_parallel.py --schedule 1f1b|interleaved|zbv
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

from common import SIZES, VOCAB, Block, Size, adamw, cross_entropy, random_batch, report, time_steps

SCHEDULES = {"1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B, "zbv": ScheduleZBVZeroBubble}


class StageModule(nn.Module):
    """Blocks of one pipeline stage, with the embeddings on the first and norm and head on the last."""

    def __init__(self, size: Size, seq: int, blocks: int, first: bool, last: bool):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, size.hidden) if first else None
        self.positions = nn.Embedding(seq, size.hidden) if first else None
        self.blocks = nn.ModuleList(Block(size.hidden, size.heads) for _ in range(blocks))
        self.norm = nn.LayerNorm(size.hidden) if last else None
        self.head = nn.Linear(size.hidden, VOCAB, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tokens is not None:
            x = self.tokens(x) + self.positions(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) if self.head is not None else x


def stage_ids(schedule: str, rank: int, world: int) -> list[int]:
    """The pipeline stages this rank holds: one; two round robin; or two in a V (ZBV)."""
    if schedule == "1f1b":
        return [rank]
    if schedule == "zbv":
        return [rank, 2 * world - 1 - rank]
    return [rank, rank + world]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES))
    parser.add_argument("--size", default="1.3b", choices=sorted(SIZES))
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=8, help="per step")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="compile each block")
    args = parser.parse_args()
    rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    size = SIZES[args.size]
    ids = stage_ids(args.schedule, rank, world)
    stages_total = world * len(ids)
    torch.manual_seed(rank)
    stages, params = [], []
    for i in ids:
        module = StageModule(size, args.seq, size.layers // stages_total, i == 0, i == stages_total - 1).to(device)
        if args.compile:
            for j, block in enumerate(module.blocks):
                module.blocks[j] = torch.compile(block)
        params += list(module.parameters())
        stages.append(PipelineStage(module, i, stages_total, device))
    schedule_cls = SCHEDULES[args.schedule]
    schedule = schedule_cls(stages[0] if args.schedule == "1f1b" else stages, args.micro_batches, loss_fn=cross_entropy)
    optimizer = adamw(params)
    tokens, labels = random_batch(args.micro_batch * args.micro_batches, args.seq, device)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)

    def step():
        targets = {"target": labels} if last else {}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            schedule.step(tokens, **targets) if first else schedule.step(**targets)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    timing = time_steps(step, args.warmup, args.steps, barrier=dist.barrier)
    peak = torch.tensor([timing.peak_gib], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the busiest stage
    timing.peak_gib = peak.item()
    if rank == 0:
        print(report(f"torch-pp{world}-{args.schedule}", args.size, args.seq,
                     args.micro_batch * args.micro_batches * args.seq / world, timing, micro_batch=args.micro_batch,
                     micro_batches=args.micro_batches, compile=args.compile), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
