"""Causal self-attention, multi-head or grouped-query, with learned or rotary positions.

The fused ``qkv`` projection stores its output rows grouped by key/value head: for each kv head
``g`` come the ``r = num_heads / kv_heads`` query heads that read it, then ``k_g``, then ``v_g``,
each ``head_dim`` rows. Any split of those rows into equal contiguous parts at group boundaries is
therefore a set of whole attention groups, which is what lets a column-parallel split (kv_heads
divisible by tp) give each rank complete heads without the model knowing about it: the forward
pass infers how many groups it holds from the projection's output width.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from models import ops
from models.config import ModelConfig
from models.kv_cache import LayerCache, Start, positions


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(d)) v with attention dropout: the part selective recompute re-runs.

    It is a module of its own (no parameters) so it can be checkpointed by name and so its dropout
    can be drawn from the tensor-parallel RNG: its heads differ from one tp rank to the next.
    """

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ops.attention(q, k, v, self.dropout if self.training else 0.0)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.queries_per_group = cfg.num_heads // cfg.kv_heads
        self.rope_theta = cfg.rope_theta if cfg.position_embedding == "rope" else None
        width = (cfg.num_heads + 2 * cfg.kv_heads) * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, width, bias=cfg.bias, device=device)
        self.core = AttentionCore(cfg.attention_dropout)
        self.out = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.bias, device=device)
        if self.rope_theta is not None:
            # cos and sin of every position, computed once (``reset_rotary``) rather than in each forward:
            # inside a compiled block inductor fused the tables' arange, power, cos and sin into the
            # rotation's kernels, evaluating them per element of q and k, forward and backward, which
            # made the Llama preset's three rotary kernels cost 50 ms of a 297 ms step at 1.3B
            # (BENCHMARKS.md). Not saved with the weights: they follow from the config.
            table = (cfg.seq_length, cfg.head_dim // 2)
            self.register_buffer("rotary_cos", torch.empty(table, device=device), persistent=False)
            self.register_buffer("rotary_sin", torch.empty(table, device=device), persistent=False)
            if torch.device(device or "cpu").type != "meta":
                self.reset_rotary()

    @torch.no_grad()
    def reset_rotary(self) -> None:
        """Fill the rotary tables (fp32), e.g. after ``to_empty`` materialised them uninitialised."""
        cos, sin = ops.rotary_tables(self.rotary_cos.shape[0], self.head_dim, self.rope_theta,
                                     self.rotary_cos.device, torch.float32)
        self.rotary_cos.copy_(cos)
        self.rotary_sin.copy_(sin)

    def rotary(self, seq: int, dtype: torch.dtype, start: Start = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions start..start+seq-1 in ``dtype``: the tables' rows (rounded from
        fp32, as ``ops.rotary_tables`` rounds), or computed for a sequence longer than the config's.
        A device ``start`` (a CUDA graph's decode) is inside the tables: its cache is no longer."""
        if not isinstance(start, int):
            rows = positions(start, seq, self.rotary_cos.device)
            return self.rotary_cos.index_select(0, rows).to(dtype), self.rotary_sin.index_select(0, rows).to(dtype)
        end = start + seq
        if end > self.rotary_cos.shape[0]:
            cos, sin = ops.rotary_tables(end, self.head_dim, self.rope_theta, self.rotary_cos.device, dtype)
            return cos[start:], sin[start:]
        return self.rotary_cos[start:end].to(dtype), self.rotary_sin[start:end].to(dtype)

    def forward(self, x: torch.Tensor, cache: Optional[LayerCache] = None) -> torch.Tensor:
        """x [batch, seq, hidden] -> [batch, seq, hidden]; heads held = qkv output width / group width.
        With a ``cache`` (decoding, no dropout) the tokens of ``x`` follow those it holds, and their
        queries read its keys and values as well as their own."""
        qkv = self.qkv(x)
        batch, seq = qkv.shape[:2]  # not x's: under sequence parallelism x holds a chunk of the tokens
        r = self.queries_per_group
        groups = qkv.view(batch, seq, -1, r + 2, self.head_dim)
        q = groups[..., :r, :].flatten(2, 3)  # [batch, seq, heads, head_dim]
        k, v = groups[..., r, :], groups[..., r + 1, :]  # [batch, seq, kv_heads, head_dim]
        start = 0 if cache is None else cache.start
        if self.rope_theta is not None:
            cos, sin = self.rotary(seq, q.dtype, start)
            q, k = ops.apply_rotary(q, cos, sin), ops.apply_rotary(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is None:
            y = self.core(q, k, v)
        else:
            y = ops.attention_from(q, *cache.extend(k, v), start)
        return self.out(y.transpose(1, 2).reshape(batch, seq, -1))
