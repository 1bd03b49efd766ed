"""What every peer baseline shares: the GPT a user would write in plain PyTorch, the sizes, the
FLOP count and the timing loop, so the programs differ only in how they parallelize.

The model is the nanoGPT shape of megazero's ``gpt2`` preset: learned positions, pre-LayerNorm
blocks with a fused qkv projection, tanh-GELU MLP of 4x width, PyTorch's SDPA attention, and a head
tied to the token embedding (``tied=False`` unties it, as the tensor- and pipeline-parallel peers
need). Throughput is tokens/s per GPU; TFLOP/s count 6·N + 12·layers·hidden·seq FLOPs per token,
with N the parameters of the tied model (the head counted once), and MFU divides by the dense bf16
peak of an H100/H200 SXM (989 TFLOP/s).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 128, as megazero pads it
PEAK_TFLOPS = 989.0


@dataclass(frozen=True)
class Size:
    layers: int
    hidden: int
    heads: int


SIZES = {"125m": Size(12, 768, 12), "350m": Size(24, 1024, 16), "760m": Size(24, 1536, 16),
         "1.3b": Size(24, 2048, 16), "6.7b": Size(32, 4096, 32)}


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc_in, self.fc_out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, hidden // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.fc_out(F.gelu(self.fc_in(self.norm2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, size: Size, seq: int, tied: bool = True):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, size.hidden), nn.Embedding(seq, size.hidden)
        self.blocks = nn.ModuleList(Block(size.hidden, size.heads) for _ in range(size.layers))
        self.norm = nn.LayerNorm(size.hidden)
        self.head = nn.Linear(size.hidden, VOCAB, bias=False)
        if tied:
            self.head.weight = self.tokens.weight

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return cross_entropy(self.head(self.norm(x)), labels)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def flops_per_token(size: Size, seq: int) -> float:
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(size, seq).parameters())
    return 6 * params + 12 * size.layers * size.hidden * seq


def layout_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every multi-axis peer takes: model size, sequence, tensor and pipeline degrees
    (the data-parallel degree is what the processes leave), micro-batch and timing."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--size", default="1.3b", choices=sorted(SIZES))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    return p


def adamw(params, lr: float = 1e-4, fused: bool = True) -> torch.optim.Optimizer:
    """The optimizer every peer uses (megazero's defaults): AdamW, betas (0.9, 0.95), decay 0.1; fused,
    or foreach where the parameters are DTensors."""
    implementation = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, **implementation)


def random_batch(batch: int, seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    return tuple(torch.randint(0, VOCAB, (batch, seq), device=device, generator=g) for _ in range(2))


@dataclass
class Timing:
    step_ms: float
    peak_gib: float


def time_steps(step: Callable[[], object], warmup: int, steps: int, barrier: Callable[[], None] = lambda: None) -> Timing:
    """Mean wall time of ``steps`` calls of ``step`` after ``warmup`` (compilation, allocator warm-up),
    and the peak memory allocated during the timed ones."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return Timing(1e3 * (time.perf_counter() - start) / steps, torch.cuda.max_memory_allocated() / 2**30)


def report(mode: str, size_name: str, seq: int, tokens_per_step_per_gpu: float, timing: Timing, **extra) -> str:
    """One JSON line: tokens/s and TFLOP/s per GPU, MFU, step time and peak memory."""
    tokens = tokens_per_step_per_gpu / (timing.step_ms / 1e3)
    tflops = tokens * flops_per_token(SIZES[size_name], seq) / 1e12
    line = {"mode": mode, "model": size_name, "seq": seq, **extra, "tokens_per_s_per_gpu": round(tokens),
            "tflops_per_gpu": round(tflops, 1), "mfu_989": round(tflops / PEAK_TFLOPS, 3),
            "step_ms": round(timing.step_ms, 1), "peak_GiB": round(timing.peak_gib, 1)}
    return json.dumps(line)
