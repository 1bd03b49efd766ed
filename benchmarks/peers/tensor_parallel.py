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
from torch.distributed.tensor import DTensor, Replicate, Shard
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
    """The GPT, or one pipeline stage of it: ``blocks`` blocks (all by default), with the embedding
    and the final norm and head where the stage is the first or the last."""

    def __init__(self, size: Size, blocks: range | None = None, embedding: bool = True, head: bool = True):
        super().__init__()
        blocks = range(size.layers) if blocks is None else blocks
        torch.manual_seed(0)
        self.tokens = nn.Embedding(VOCAB, size.hidden) if embedding else None
        self.blocks = nn.ModuleList()
        for index in blocks:  # each block's weights by its own index, whatever the split
            torch.manual_seed(1 + index)
            self.blocks.append(Block(size.hidden, size.heads))
        torch.manual_seed(size.layers + 1)
        self.norm = nn.LayerNorm(size.hidden) if head else None
        self.head = nn.Linear(size.hidden, VOCAB, bias=False) if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tokens is not None:
            x = self.tokens(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) if self.head is not None else x


def sharded_adamw(params, lr: float = 1e-4) -> torch.optim.Optimizer:
    """The peers' AdamW (``common.adamw``) for DTensor parameters: foreach, with DTensors and plain
    tensors (the replicated norms without sequence parallelism) in separate groups, as one foreach
    call cannot mix them."""
    params = list(params)
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return adamw([{"params": g} for g in groups if g], lr=lr, fused=False)


def between_blocks(sequence_parallel: bool):
    """The residual stream's layout between blocks: sequence-sharded, or replicated."""
    return Shard(1) if sequence_parallel else Replicate()


def parallelize_block(block: Block, mesh, sequence_parallel: bool) -> None:
    """The torchtitan plan for one block: q, k, v and the MLP's first linear column-parallel, the
    attention output and the MLP's second row-parallel, the norms sequence-parallel."""
    between = between_blocks(sequence_parallel)
    plan = {"attn": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.out": RowwiseParallel(output_layouts=between),
            "mlp": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
            "mlp.fc_in": ColwiseParallel(), "mlp.fc_out": RowwiseParallel(output_layouts=between)}
    if sequence_parallel:
        plan.update({"norm1": SequenceParallel(), "norm2": SequenceParallel()})
    parallelize_module(block, mesh, plan)


def outer_plan(sequence_parallel: bool, embedding: bool = True, head: bool = True, local_logits: bool = False) -> dict:
    """The embedding vocabulary-parallel into the blocks' layout; the final norm and the head, whose
    logits stay sharded over the vocabulary for the loss (a DTensor, or this rank's shard)."""
    between = between_blocks(sequence_parallel)
    plan = {}
    if embedding:
        plan["tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if head:
        plan["head"] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=local_logits)
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
    return plan


def parallelize(model: TensorParallelGPT, mesh, sequence_parallel: bool) -> None:
    """The torchtitan plan: between blocks the residual stream is sequence-sharded (or replicated)."""
    parallelize_module(model, mesh, outer_plan(sequence_parallel))
    for block in model.blocks:
        parallelize_block(block, mesh, sequence_parallel)


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
    model = TensorParallelGPT(SIZES[args.size]).cuda()
    parallelize(model, mesh, not args.no_sp)
    if args.async_tp:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        torch._inductor.config._micro_pipeline_tp = True
        enable_symm_mem_for_group(mesh.get_group().group_name)
    if args.compile:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, fullgraph=True)
    optimizer = sharded_adamw(model.parameters())
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
