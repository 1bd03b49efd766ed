"""The data-parallel peers on the GPT of ``common.py``: torch DDP, torch FSDP2 (parameters, gradients
and optimizer state sharded per block, the ZeRO-3 layout) and DeepSpeed ZeRO stages 1, 2 and 3.
Each rank trains one micro-batch per step in bf16 (DDP and FSDP2 by autocast and, for FSDP2, a
bf16 parameter policy with fp32 reduction; DeepSpeed by its bf16 mode with fp32 master weights).

    torchrun --nproc-per-node 2 benchmarks/peers/data_parallel.py --mode ddp|fsdp2|ds1|ds2|ds3 [--compile]
"""

from __future__ import annotations

import argparse
import os
from typing import Callable

import torch
import torch.distributed as dist

from common import GPT, SIZES, adamw, random_batch, report, time_steps


def torch_step(model: torch.nn.Module, mode: str, compiled: bool, batch) -> Callable[[], None]:
    if mode == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        wrapped = fully_shard(model, mp_policy=policy)
    forward = torch.compile(wrapped) if compiled else wrapped
    optimizer = adamw(wrapped.parameters())

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def deepspeed_step(model: torch.nn.Module, stage: int, micro_batch: int, batch) -> Callable[[], None]:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True}, "gradient_clipping": 0.0, "steps_per_print": 10**9,
              "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters()), config=config)

    def step():
        engine.backward(engine(*batch))
        engine.step()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", required=True, choices=["ddp", "fsdp2", "ds1", "ds2", "ds3"])
    parser.add_argument("--size", default="1.3b", choices=sorted(SIZES))
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (DDP and FSDP2)")
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    torch.manual_seed(0)
    model = GPT(SIZES[args.size], args.seq).cuda()
    batch = random_batch(args.micro_batch, args.seq, "cuda")
    if args.mode.startswith("ds"):
        step = deepspeed_step(model, int(args.mode[2]), args.micro_batch, batch)
    else:
        step = torch_step(model, args.mode, args.compile, batch)
    timing = time_steps(step, args.warmup, args.steps, barrier=dist.barrier)
    if dist.get_rank() == 0:
        print(report(args.mode, args.size, args.seq, args.micro_batch * args.seq, timing, micro_batch=args.micro_batch,
                     compile=args.compile, world=dist.get_world_size()), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
