"""Causal attention through FlashAttention 4's CuTe kernels (the optional ``flash-attn-4`` package).

On Hopper, torch's SDPA picks cuDNN's attention; FlashAttention 4 ships Hopper kernels written in
NVIDIA's CuTe DSL and compiled on first use from Python, so it installs as wheels with no extension
to build against torch. In a compiled GPT step it measured 0.8-3% faster than SDPA where the seam
uses it (``kernels.flash_attention_fits`` says where; BENCHMARKS.md has the figures). Both ops here
are ``torch.library`` custom ops with shape-only fake bodies: dynamo traces each as one node of a
compiled block (no graph break), and CUDA-graph capture replays their launches.

Layout: the kernels take ``[batch, seq, heads, head_dim]``, the layout the model's ``qkv`` projection
already produces, so the seam's ``[batch, heads, seq, head_dim]`` views are transposed back for free.
The forward saves its output and the fp32 log-sum-exp of each row ``[batch, heads, seq]``; the
backward reads them (as SDPA's cuDNN path does). The backward runs ``deterministic``: each query
tile's gradient is summed in a fixed order, so the same step gives the same bits (the unordered
backward measured 0.2% faster in the step).
"""

from __future__ import annotations

import torch
from torch import Tensor


def load_interface():
    """The package's forward and backward functions, called directly (its autograd function runs both
    inside one Python object that dynamo cannot trace as an op); they are not its public API, which
    is why the ``flash`` extra pins the version measured. Imported when a run starts
    (``kernels.settle_kernels``) or at first use, not with this module: the CuTe DSL takes a
    few seconds to import."""
    from flash_attn.cute import interface

    return interface


@torch.library.custom_op("megazero::flash_attention_forward", mutates_args=(), device_types="cuda")
def _forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    out, lse, *_ = load_interface()._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True)
    return out.contiguous(), lse.contiguous()


@_forward.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    batch, seq, heads, _ = q.shape
    return q.new_empty(batch, seq, heads, v.shape[-1]), q.new_empty(batch, heads, seq, dtype=torch.float32)


@torch.library.custom_op("megazero::flash_attention_backward", mutates_args=(), device_types="cuda")
def _backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
              scale: float) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = load_interface()._flash_attn_bwd(q, k, v, out, grad.contiguous(), lse, scale, True,
                                                  deterministic=True)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_backward.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
      scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save(ctx, inputs, output) -> None:
    q, k, v, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale = scale


def _gradients(ctx, grad_out: Tensor, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _backward(grad_out, q, k, v, out, lse, ctx.scale)
    return dq, dk, dv, None


_forward.register_autograd(_gradients, setup_context=_save)


def attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention of ``models.ops.attention``'s layout (q [batch, heads, seq, head_dim], k and v
    with ``kv_heads`` heads, grouped-query when fewer), scaled by 1/sqrt(head_dim); no dropout."""
    out, _ = _forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), q.shape[-1] ** -0.5)
    return out.transpose(1, 2)
