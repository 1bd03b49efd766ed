"""The fused-ops seam: every numerically heavy primitive the decoder calls, in plain torch.

The model calls these functions and nothing lower, so fast GPU kernels (fused norms, flash
attention, fused rotary, a fused cross-entropy) can replace a body here later without touching the
model or changing its numerics beyond rounding. Each function documents the shapes it accepts;
a replacement must keep them.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""Label value whose position contributes neither loss nor gradient (padding, document masks)."""


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension."""
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in fp32 so bf16 activations keep their scale."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


def gelu(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of GeLU, as GPT-2 and Megatron use."""
    return F.gelu(x, approximate="tanh")


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, the gated unit of Llama's MLP."""
    return F.silu(gate) * up


def rotary_tables(seq_len: int, head_dim: int, theta: float, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [seq, head_dim/2] for positions 0..seq-1 (computed in fp32)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the last dim of ``x`` [batch, seq, heads, head_dim].

    This is the "rotate half" convention of GPT-NeoX and Hugging Face Llama checkpoints.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Causal attention; q [batch, heads, seq, head_dim], k and v [batch, kv_heads, seq, head_dim].

    Grouped-query attention: query head ``i`` reads key/value head ``i // (heads // kv_heads)``.
    """
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                          enable_gqa=q.shape[1] != k.shape[1])


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token loss (fp32) of logits [..., vocab] against labels [...]; ignored positions give 0."""
    flat = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="none")
    return flat.view(labels.shape)
