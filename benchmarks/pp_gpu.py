"""Pipeline throughput and bubble on GPUs: a 1B-class GPT split over pp=2 stages with NCCL.

Run on one node with two GPUs::

    torchrun --nproc_per_node 2 benchmarks/pp_gpu.py [--micro-batches 2 4 8 16] [--schedules 1f1b ...]

For each (schedule, micro-batch count) it prints one JSON line (rank 0): tokens/s over timed steps,
and the measured bubble against the theory. Measured bubble = (step time - time inside forward and
backward) / time inside forward and backward, on the rank that idles most, from profiled steps
that time every forward and backward with CUDA events; theory = (pp - 1) / (v m) with stages
of equal speed, a third of that for zb-h1 (pp - 1 for gradient_accumulation, which does not pipeline at all). Only the
pipeline is timed (no optimizer step), so the numbers isolate the schedule. ``--cpu`` runs the
same code on gloo with whatever (tiny) sizes are given, to check the script without GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from megazero.engine import gpt_forward_step
from megazero.flops import attention_share, head_blocks
from models import GPT
from models.config import ModelConfig
from parallel.pipeline import PipelineExecutor, bubble_fraction, sum_tied_grads
from parallel.pipeline.partition import resolve_split, stage_layers, stage_parts
from parallel.pipeline.placement import V_SHAPED, placement_of, stage_of
from parallel.pipeline.schedule import INTERLEAVED
from parallel.topology import RankGrid, Topology


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--schedules", nargs="+", default=["gradient_accumulation", "1f1b", "interleaved_1f1b", "zb-h1"])
    p.add_argument("--steps", type=int, default=5, help="timed steps per config (after 2 warm-up steps)")
    p.add_argument("--profiled-steps", type=int, default=2)
    p.add_argument("--cpu", action="store_true", help="run on CPU with gloo (to check the script, not to time)")
    return p.parse_args()


def tied_embedding_params(chunks) -> list:
    """The copies of the tied embedding this rank holds (a first-stage embedding, a last-stage head)."""
    found = {id(p): p for c in chunks if c.tied for p in
             ([c.embedding.tokens.weight] if c.embedding is not None else [])
             + ([c.lm_head.weight] if c.lm_head is not None else [])}
    return list(found.values())


def build_chunks(cfg: ModelConfig, pp: int, rank: int, v: int, device, placement: str = "loop") -> list:
    split = resolve_split(cfg.num_layers, pp, v, head_cost=head_blocks(cfg),
                          attention_share=attention_share(cfg), placement=placement)  # as the engine splits
    chunks = []
    for chunk in range(v):
        stage = stage_of(pp, rank, chunk, placement)
        model = GPT(cfg, layers=stage_layers(split, pp, rank, chunk, placement),
                    parts=stage_parts(split, pp, rank, chunk, placement),
                    has_embedding=stage == 0, has_head=stage == pp * v - 1, device=device)
        chunks.append(model.to(torch.bfloat16))
    return chunks


def measured_bubble(executor: PipelineExecutor, step, steps: int, device) -> float:
    """The pipeline's measured bubble: idle over busy time on the idlest stage, where busy is the time
    of its forward and backward ops on the GPU (events, so waits for a neighbour count as idle) and
    idle the rest of the executor's step; the least of ``steps`` profiled calls of ``step``."""
    executor.profile = True
    try:
        bubbles = []
        for _ in range(steps):
            step()
            bubbles.append(executor.stats.bubble)
    finally:
        executor.profile = False
    bubble = torch.tensor(min(bubbles), device=device)
    dist.all_reduce(bubble, op=dist.ReduceOp.MAX)  # the idlest stage sets the pace
    return bubble.item()


def run_config(args, cfg, topo, device, schedule: str, m: int) -> dict:
    v = 2 if schedule in INTERLEAVED + V_SHAPED else 1
    if m % topo.pp_size and schedule in INTERLEAVED:
        return {}
    chunks = build_chunks(cfg, topo.pp_size, topo.pp_rank, v, device, placement_of(schedule))
    shape = (args.micro_batch_size, cfg.seq_length, cfg.hidden_size)
    executor = PipelineExecutor(chunks, topo, shape, dtype=torch.bfloat16, device=device, schedule=schedule,
                                forward_step=gpt_forward_step)
    g = torch.Generator(device=device).manual_seed(0)
    data = [dict.fromkeys(("tokens", "labels"), torch.randint(0, cfg.vocab_size, shape[:2], device=device,
                                                              generator=g)) for _ in range(m)]
    tied = tied_embedding_params(chunks)
    tied_group = topo.embedding_group if placement_of(schedule) == "loop" else None  # a V holds both copies

    def one_step():
        if executor.rehearsal_due(len(data)):  # the first step's kernels load before any transfer (see ``rehearse``)
            executor.rehearse(data)
        for c in chunks:
            c.zero_grad(set_to_none=True)
        loss = executor.step(data)
        sum_tied_grads([p.grad for p in tied if p.grad is not None], tied_group)
        return loss

    for _ in range(2):
        one_step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = one_step()
    synchronize(device)
    elapsed = time.perf_counter() - start
    bubble = measured_bubble(executor, one_step, args.profiled_steps, device)
    theory = bubble_fraction(topo.pp_size, m, v, schedule)
    tokens = args.steps * m * args.micro_batch_size * cfg.seq_length
    result = {"schedule": schedule, "pp": topo.pp_size, "v": v, "micro_batches": m,
              "micro_batch_size": args.micro_batch_size, "seq": cfg.seq_length,
              "params_b": round(sum(p.numel() for c in chunks for p in c.parameters()) * topo.pp_size / 1e9, 2),
              "tokens_per_s": round(tokens / elapsed, 1), "step_s": round(elapsed / args.steps, 4),
              "bubble_measured": round(bubble, 4), "bubble_theory": round(theory, 4),
              "held_outputs_mib": round(executor.stats.peak_held_bytes / 2**20, 2), "loss": round(loss.item(), 4)}
    if device.type == "cuda":
        result.update(peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                      gpu=torch.cuda.get_device_name())
        del executor, chunks
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return result


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.cpu:  # a functional smoke run of this script on gloo, with a tiny model
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl")  # lazily initialised communicators, as the engine uses them
    topo = Topology(RankGrid(tp=1, pp=dist.get_world_size(), dp=1))
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                      vocab_size=args.vocab, seq_length=args.seq)
    for schedule in args.schedules:
        for m in args.micro_batches:
            result = run_config(args, cfg, topo, device, schedule, m)
            if result and dist.get_rank() == 0:
                print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
