"""The composed peer: torch-native tensor, pipeline and data parallelism together, as torchtitan
composes them. Inside each pipeline stage the DTensor plans of ``tensor_parallel.py`` (sequence
parallel by default); across stages ``torch.distributed.pipelining`` (1F1B, or interleaved 1F1B with
two stages a rank); across replicas FSDP2 (bf16 parameters, fp32 gradient reduction; under a
pipeline the parameters stay gathered between micro-batches, torchtitan's setting). It runs the
layouts that the one-axis peers cannot: tp x dp, pp x dp, tp x pp, and all three.

The model is ``tensor_parallel.py``'s (separate q, k and v, untied head, no position table), each
block initialised from its own index, so every layout trains the same weights; FLOPs are counted
as for the tied model, as in the other peers. Tokens/s are per GPU.

    torchrun --nproc-per-node 4 benchmarks/peers/composed_parallel.py --tp 2 --compile          # tp 2 x dp 2
    torchrun --nproc-per-node 4 benchmarks/peers/composed_parallel.py --pp 2 --compile          # pp 2 x dp 2
    torchrun --nproc-per-node 4 benchmarks/peers/composed_parallel.py --tp 2 --pp 2 --compile   # tp 2 x pp 2

``--cpu`` (gloo, fp32, a four-block model of hidden 64, no timing) prints the first three steps'
losses instead. Every layout must give the losses of one process running the same global batch
(``--micro-batches`` times the replicas), which checks that the peer does the work of the model it
stands for: the replicas take different slices of the batch, so an unaveraged gradient shows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from common import SIZES, Size, layout_parser, random_batch, report, time_steps
from pipeline_parallel import SCHEDULES as PIPELINE_SCHEDULES, stage_ids
from tensor_parallel import TensorParallelGPT, outer_plan, parallelize_block, sharded_adamw

SCHEDULES = {name: PIPELINE_SCHEDULES[name] for name in ("1f1b", "interleaved")}  # ZBV refuses compiled stages
CPU_SIZE, CPU_SEQ = Size(4, 64, 4), 32


def parse_args() -> argparse.Namespace:
    p = layout_parser(__doc__.splitlines()[0])
    p.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES), help="with --pp above 1")
    p.add_argument("--micro-batches", type=int, default=None, help="per step and replica (default: 8 with a "
                                                                    "pipeline, else 1)")
    p.add_argument("--compile", action="store_true", help="compile each block")
    p.add_argument("--no-sp", action="store_true", help="replicate the residual stream between blocks")
    p.add_argument("--cpu", action="store_true", help="gloo and a tiny fp32 model: print losses, no timing")
    return p.parse_args()


def build_stage(size: Size, stage: int, stages: int, mesh, args, dp: int, mixed: bool) -> TensorParallelGPT:
    """One pipeline stage with tensor parallelism, compiled blocks and FSDP2, in torchtitan's order."""
    per_stage = size.layers // stages
    module = TensorParallelGPT(size, range(stage * per_stage, (stage + 1) * per_stage),
                               embedding=stage == 0, head=stage == stages - 1)
    module.to("cpu" if args.cpu else "cuda")
    sp = not args.no_sp
    if args.tp > 1:
        for block in module.blocks:
            parallelize_block(block, mesh["tp"], sp)
        parallelize_module(module, mesh["tp"], outer_plan(sp, embedding=module.tokens is not None,
                                                          head=module.head is not None, local_logits=True))
    if args.compile:
        for j, block in enumerate(module.blocks):
            module.blocks[j] = torch.compile(block, fullgraph=True)
    if dp > 1:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed \
            else MixedPrecisionPolicy()
        for block in module.blocks:
            fully_shard(block, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=args.pp == 1)
        fully_shard(module, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=args.pp == 1)
    return module


def main() -> None:
    args = parse_args()
    world = int(os.environ["WORLD_SIZE"])
    if world % (args.tp * args.pp):
        raise SystemExit(f"{world} processes do not divide into tp {args.tp} x pp {args.pp}")
    dp = world // (args.tp * args.pp)
    micro_batches = args.micro_batches or (8 if args.pp > 1 else 1)
    if args.cpu:
        dist.init_process_group("gloo")
        device, size, seq, micro_batch = torch.device("cpu"), CPU_SIZE, CPU_SEQ, 2
    else:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        size, seq, micro_batch = SIZES[args.size], args.seq, args.micro_batch
    mesh = init_device_mesh(device.type, (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank = mesh.get_local_rank("pp")
    ids = stage_ids(args.schedule if args.pp > 1 else "1f1b", pp_rank, args.pp)
    stages = args.pp * len(ids)
    if size.layers % stages:
        raise SystemExit(f"{size.layers} layers do not split evenly over {stages} pipeline stages")
    # bf16: FSDP2's parameters where there are replicas, else autocast; the CPU check runs in fp32
    mixed = not args.cpu
    modules = [build_stage(size, i, stages, mesh, args, dp, mixed) for i in ids]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if mixed and dp == 1 else contextlib.nullcontext()
    tensor_parallel = args.tp > 1

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if tensor_parallel:  # this rank's vocabulary shard of the logits
            logits = DTensor.from_local(logits, mesh["tp"], [Shard(-1)], run_check=False)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    params = [p for m in modules for p in m.parameters()]
    optimizer = sharded_adamw(params, lr=1e-3 if args.cpu else 1e-4)
    # one batch for all replicas, each taking its slice, so that the replicas' gradients differ and
    # the check below sees whether FSDP2 averages them
    dp_rank = mesh.get_local_rank("dp")
    tokens, labels = (t.chunk(dp)[dp_rank] for t in random_batch(micro_batch * micro_batches * dp, seq, device))
    schedule = None
    if args.pp > 1:
        pipeline = [PipelineStage(m, i, stages, device, group=mesh["pp"].get_group()) for m, i in zip(modules, ids)]
        schedule = SCHEDULES[args.schedule](pipeline[0] if len(pipeline) == 1 else pipeline, micro_batches,
                                            loss_fn=loss_fn)
        first, last = any(s.is_first for s in pipeline), any(s.is_last for s in pipeline)

    def step() -> torch.Tensor | None:
        """One optimizer step; the mean loss over its micro-batches where this rank computes it."""
        with loss_parallel() if tensor_parallel else contextlib.nullcontext(), autocast:
            if schedule is not None:
                losses = []
                targets = {"target": labels, "losses": losses} if last else {}
                schedule.step(tokens, **targets) if first else schedule.step(**targets)
                loss = torch.stack(losses).mean() if last else None
            else:
                loss = 0.0
                for i, (x, y) in enumerate(zip(tokens.chunk(micro_batches), labels.chunk(micro_batches))):
                    if dp > 1:  # reduce the gradients once, after the last micro-batch
                        modules[0].set_requires_gradient_sync(i == micro_batches - 1)
                    part = loss_fn(modules[0](x), y) / micro_batches
                    part.backward()
                    loss = loss + part.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss  # loss_parallel's is replicated

    name = f"torch-tp{args.tp}-pp{args.pp}-dp{dp}" + (f"-{args.schedule}" if args.pp > 1 else "") + \
        ("" if args.no_sp or args.tp == 1 else "-sp")
    last_stage = pp_rank == args.pp - 1
    if args.cpu:
        losses = [step() for _ in range(3)]
        if last_stage:  # the mean over the replicas' slices: the whole batch's loss
            losses = torch.stack(losses)
            dist.all_reduce(losses, group=mesh["dp"].get_group())
            losses /= dp
        if last_stage and dp_rank == 0 and mesh.get_local_rank("tp") == 0:
            print(json.dumps({"mode": name, "cpu_losses": [round(float(loss), 6) for loss in losses]}), flush=True)
        dist.destroy_process_group()
        return
    timing = time_steps(step, args.warmup, args.steps, barrier=dist.barrier)
    peak = torch.tensor([timing.peak_gib], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the fullest rank
    timing.peak_gib = peak.item()
    if dist.get_rank() == 0:
        print(report(name, args.size, seq, micro_batch * micro_batches * seq * dp / world, timing,
                     micro_batch=micro_batch, micro_batches=micro_batches, compile=args.compile), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
