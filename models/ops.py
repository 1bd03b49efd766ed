"""The fused-ops seam: every numerically heavy primitive the decoder calls.

The model calls these functions and nothing lower. Each body here is plain torch: the reference,
and what runs on the CPU. On a CUDA tensor a fused kernel from ``models.kernels`` replaces it where
one was measured to be faster (that package's docstring has the table and the reasons); the
replacement keeps the shapes and the numerics up to rounding, and such an op's ``op.reference``
stays callable so tests and benchmarks can put the two side by side. ``MEGAZERO_KERNELS=0`` turns every
replacement off.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from models import kernels
from models.kv_cache import Start, positions

IGNORE_INDEX = -100
"""Label value whose position contributes neither loss nor gradient (padding, document masks)."""
REDUCTIONS = ("none", "sum")
"""What ``linear_cross_entropy`` returns: the loss of every token, or their sum."""


def fused_by(body: str, in_graph: bool = False, needs: str = "triton"):
    """Let ``models.kernels.<body>`` replace the decorated torch reference on CUDA tensors.

    ``in_graph``: also while torch.compile traces, as an eager call between two graphs; ``needs``:
    the optional package the body runs on (see ``kernels.use_fused``).
    """
    def decorate(reference: Callable) -> Callable:
        @functools.wraps(reference)
        def op(*args, **kwargs):
            if kernels.use_fused(args[0], in_graph, needs):
                return (kernels.call_between_graphs if in_graph else kernels.call)(body, *args, **kwargs)
            return reference(*args, **kwargs)

        op.reference = reference
        return op
    return decorate


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension.

    No fused body: torch's eager LayerNorm is one kernel each way and was measured faster than
    liger-kernel's (BENCHMARKS.md); under torch.compile inductor generates its own.
    """
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


@fused_by("liger.rms_norm", needs="liger")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in fp32 so bf16 activations keep their scale."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


def add_layer_norm(x: torch.Tensor, branch: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual sum ``x + branch`` and its LayerNorm, as one op (a pre-norm block adds a branch to
    the residual stream and normalises the sum next).

    No fused body: ``models.kernels.norms`` has one, but torch's eager add and LayerNorm were measured
    faster forward+backward on an H100 (BENCHMARKS.md); under torch.compile inductor fuses the two.
    """
    total = x + branch
    return total, layer_norm(total, weight, bias, eps)


@fused_by("norms.add_rms_norm")
def add_rms_norm(x: torch.Tensor, branch: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual sum ``x + branch`` and its RMSNorm, as one op: the fused body reads the two once,
    writes both outputs, and in backward writes one gradient for x and the branch alike."""
    total = x + branch
    return total, rms_norm(total, weight, eps)


def gelu(x: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """GeLU: by default its tanh approximation, as GPT-2 and Megatron's fused bias-GeLU compute it;
    ``exact``: with erf, as megatron-core computes it elsewhere (a model without linear biases) and
    Hugging Face's ``gelu``. The two differ by up to about 5e-4 an activation, so a converted model
    keeps the one it was trained with.

    No fused body: the bias is already added in the GEMM's epilogue (cuBLAS, eager and compiled),
    and GeLU is then one pass each way, at memory bandwidth under torch.compile (BENCHMARKS.md); only
    moving GeLU into the GEMM's epilogue too could save more.
    """
    return F.gelu(x, approximate="none" if exact else "tanh")


@fused_by("elementwise.swiglu")
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, the gated unit of Llama's MLP."""
    return F.silu(gate) * up


def rotary_tables(seq_len: int, head_dim: int, theta: float, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [seq, head_dim/2] for positions 0..seq-1 (computed in fp32)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@fused_by("elementwise.apply_rotary")
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
    On Hopper, FlashAttention 4's kernels replace SDPA where ``kernels.use_flash_attention`` says so
    (BENCHMARKS.md has the measurement); ``attention.reference`` is SDPA alone.
    """
    if kernels.use_flash_attention(q, dropout_p):
        return kernels.flash_attention.attention(q, k, v)
    return sdpa_attention(q, k, v, dropout_p)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """``attention`` through torch's SDPA, which picks its backend itself: cuDNN's attention on an
    H100 with torch 2.11 for bf16, 1.8x faster forward+backward than its flash backend and as fast
    as forcing cuDNN (causal and grouped-query alike; BENCHMARKS.md, benchmarks/kernels_gpu.py)."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                          enable_gqa=q.shape[1] != k.shape[1])


attention.reference = sdpa_attention


def attention_from(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: Start) -> torch.Tensor:
    """Causal attention of queries at positions ``start ..`` over keys and values at ``0 ..`` (the
    tokens a decoding cache holds, then the queries' own), without dropout: SDPA's ``is_causal``
    aligns its mask to the first key, which is right only when the two start together. One query
    (a drawn token) at a host ``start`` sees every key: no mask, whose making cost a decode five
    launches a layer. At a device ``start`` (a CUDA graph's replays) the mask is always made: it
    hides the keys past the queries, which the cache then returns too."""
    if isinstance(start, int):
        if start == 0:
            return attention(q, k, v, 0.0)
        if q.shape[2] == 1:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])
    rows = positions(start, q.shape[2], q.device)[:, None]
    visible = torch.arange(k.shape[2], device=q.device)[None, :] <= rows
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=q.shape[1] != k.shape[1])


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token loss (fp32) of logits [..., vocab] against labels [...]; ignored positions give 0."""
    flat = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="none")
    return flat.view(labels.shape)


@fused_by("cross_entropy.linear_cross_entropy", in_graph=True)
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                         reduction: str = "none") -> torch.Tensor:
    """Loss of the logits ``hidden [..., h] @ weight[padded_vocab, h]^T`` over the first ``vocab_size``
    columns: the head and the loss as one op, so that the fused body can produce and consume the
    logits a chunk of tokens at a time (the fp32 logits of the whole vocabulary never exist).

    ``reduction``: ``"none"``, the per-token loss (fp32, shaped like ``labels``, 0 where ignored),
    exact backward for any incoming gradient; or ``"sum"``, its sum over tokens (an fp32 scalar),
    whose gradient the fused body computes in the forward pass (the backward only scales it), so
    training asks for this one.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, not {reduction!r}")
    loss = cross_entropy(F.linear(hidden, weight)[..., :vocab_size], labels)
    return loss.sum() if reduction == "sum" else loss


def fused_linear_cross_entropy(hidden: torch.Tensor) -> Optional[Callable]:
    """The fused body of ``linear_cross_entropy`` for ``hidden``'s device, or None where the torch
    reference runs. After ``reduction`` it also takes ``vocab_start`` and ``combine``: the
    vocabulary-parallel loss (``parallel.tensor_parallel``) reaches it through the model's loss
    module and adds its reduction over the tensor group."""
    if kernels.use_fused(hidden, in_graph=True):
        return functools.partial(kernels.call_between_graphs, "cross_entropy.linear_cross_entropy")
    return None
