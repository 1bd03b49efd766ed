"""The tensor-parallel peer: torch-native tensor parallelism (DTensor plans, the torchtitan recipe)
on the GPT of ``common.py`` across the GPUs of one node. Attention and MLP are column- then
row-parallel, the embedding, head and loss are vocabulary-parallel, and with sequence parallelism
(the default) the norms and the residual stream are sharded along the sequence; ``--compile``
compiles each block, ``--async-tp`` lets inductor overlap the collectives with the matmuls.

Differences from ``common.GPT``, which the plans need: separate q, k and v projections (a fused qkv
cannot be split by heads with a column plan), no learned position table, an untied head. FLOPs are
counted as for the tied model, so the figures compare with the other peers. Tokens/s are per GPU
of the one replica the GPUs hold together.

    torchrun --nproc-per-node 2 benchmarks/peers/tensor_parallel.py --compile [--async-tp] [--no-sp]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

from common import SIZES, VOCAB, Size, adamw, random_batch, report, time_steps


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.q, self.k, self.v, self.out = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # this rank's heads
        return self.out(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn, self.mlp = Attention(hidden, heads), MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TensorParallelGPT(nn.Module):
    def __init__(self, size: Size):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, size.hidden)
        self.blocks = nn.ModuleList(Block(size.hidden, size.heads) for _ in range(size.layers))
        self.norm = nn.LayerNorm(size.hidden)
        self.head = nn.Linear(size.hidden, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def parallelize(model: TensorParallelGPT, mesh, sequence_parallel: bool) -> None:
    """The torchtitan plan: between blocks the residual stream is sequence-sharded (or replicated)."""
    between = Shard(1) if sequence_parallel else Replicate()
    outer = {"tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
             "head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)}
    if sequence_parallel:
        outer["norm"] = SequenceParallel()
    parallelize_module(model, mesh, outer)
    for block in model.blocks:
        plan = {"attn": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
                "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.out": RowwiseParallel(output_layouts=between),
                "mlp": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
                "mlp.fc_in": ColwiseParallel(), "mlp.fc_out": RowwiseParallel(output_layouts=between)}
        if sequence_parallel:
            plan.update({"norm1": SequenceParallel(), "norm2": SequenceParallel()})
        parallelize_module(block, mesh, plan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1.3b", choices=sorted(SIZES))
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--compile", action="store_true", help="compile each block")
    parser.add_argument("--async-tp", action="store_true", help="inductor's micro-pipelined collective matmuls")
    parser.add_argument("--no-sp", action="store_true", help="replicate the residual stream instead")
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))
    torch.manual_seed(0)
    model = TensorParallelGPT(SIZES[args.size]).cuda()
    parallelize(model, mesh, not args.no_sp)
    if args.async_tp:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        torch._inductor.config._micro_pipeline_tp = True
        enable_symm_mem_for_group(mesh.get_group().group_name)
    if args.compile:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, fullgraph=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    tokens, labels = random_batch(args.micro_batch, args.seq, "cuda")  # same seed: the same batch on every rank

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens)
        with loss_parallel():
            F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    timing = time_steps(step, args.warmup, args.steps, barrier=dist.barrier)
    if dist.get_rank() == 0:
        mode = f"torch-tp{world}" + ("" if args.no_sp else "-sp") + ("-async" if args.async_tp else "")
        print(report(mode, args.size, args.seq, args.micro_batch * args.seq / world, timing,
                     micro_batch=args.micro_batch, compile=args.compile), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
