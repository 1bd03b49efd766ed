"""SwiGLU and rotary embedding as one Triton kernel each way, for eager GPU runs.

Both read their inputs where they lie (the model hands over strided views: gate and up interleaved
in one projection, q and k sliced out of the fused qkv), compute in fp32 and write a contiguous
output, so the eager forward is one pass instead of torch's three (SwiGLU) or six (rotary), and the
backward one pass too. Under torch.compile the torch reference runs instead and inductor fuses it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _swiglu_fwd(gate_ptr, up_ptr, out_ptr, n_cols, g_row, g_col, u_row, u_col, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    g = tl.load(gate_ptr + row * g_row + cols * g_col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * u_row + cols * u_col, mask=mask, other=0.0).to(tl.float32)
    out = g * tl.sigmoid(g) * u
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(grad_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n_cols, g_row, g_col, u_row, u_col,
                BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    dy = tl.load(grad_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + row * g_row + cols * g_col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * u_row + cols * u_col, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    tl.store(dgate_ptr + row * n_cols + cols, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(dgate_ptr.dtype.element_ty),
             mask=mask)
    tl.store(dup_ptr + row * n_cols + cols, (dy * g * sig).to(dup_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [rows, last dim], a view where the strides allow (they do for the model's slices)."""
    return x.reshape(-1, x.shape[-1])


class SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        g, u = _rows(gate), _rows(up)
        out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
        grid = (g.shape[0], triton.cdiv(g.shape[1], BLOCK))
        _swiglu_fwd[grid](g, u, out, g.shape[1], *g.stride(), *u.stride(), BLOCK_N=BLOCK)
        ctx.save_for_backward(gate, up)
        return out.view(gate.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        g, u, dy = _rows(gate), _rows(up), _rows(grad.contiguous())
        dgate, dup = torch.empty(g.shape, dtype=gate.dtype, device=gate.device), torch.empty_like(dy, dtype=up.dtype)
        grid = (g.shape[0], triton.cdiv(g.shape[1], BLOCK))
        _swiglu_bwd[grid](dy, g, u, dgate, dup, g.shape[1], *g.stride(), *u.stride(), BLOCK_N=BLOCK)
        return dgate.view(gate.shape), dup.view(up.shape)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return SwiGLU.apply(gate, up)


@triton.jit
def _rotary(x_ptr, cos_ptr, sin_ptr, out_ptr, seq, heads, x_tok, x_head, half, sign,
            BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per token: all its heads, [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin] (with
    ``sign`` -1 the inverse rotation, which is the backward pass). ``out`` is contiguous."""
    tok = tl.program_id(0).to(tl.int64)
    pos = tok % seq
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < half)
    cos = tl.load(cos_ptr + pos * half + d, mask=d < half, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * half + d, mask=d < half, other=0.0).to(tl.float32) * sign
    src = x_ptr + tok * x_tok + h * x_head + d
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + tok * heads * 2 * half + h * 2 * half + d
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    batch, seq, heads, dim = x.shape
    tokens = x.reshape(batch * seq, heads, dim)  # a view for the model's q and k (batch and seq merge)
    if tokens.stride(-1) != 1:
        tokens = tokens.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _rotary[(batch * seq,)](tokens, cos.contiguous(), sin.contiguous(), out, seq, heads, tokens.stride(0),
                            tokens.stride(1), dim // 2, sign, BLOCK_H=triton.next_power_of_2(heads),
                            BLOCK_D=triton.next_power_of_2(dim // 2))
    return out


class Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, -1.0), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return Rotary.apply(x, cos, sin)
