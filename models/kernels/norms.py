"""Residual add fused with the LayerNorm or RMSNorm that follows it: one Triton kernel each way.

A pre-norm block adds its attention branch to the residual stream and normalises the sum for the
MLP. Unfused that is an add (three passes over the activations: two reads, one write) and a norm
(a read and a write), and backward adds the two incoming gradients in another pass; here the
forward reads x and the branch once and writes the sum and the normalised output, and the backward
reads dy, the sum's own gradient and the saved sum once and writes one gradient, which is that of
x and of the branch alike.

Numerics follow ``models.ops``: the sum is rounded to the activations' dtype (it is the residual
stream) and that rounded sum is normalised, in fp32; RMSNorm casts the normalised values to the
activations' dtype before the weight multiplies them, as the reference does. The weight (and bias)
gradients are summed per program in fp32, then over programs.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _add_norm_fwd(x_ptr, branch_ptr, weight_ptr, bias_ptr, sum_ptr, out_ptr, mean_ptr, rstd_ptr, n, eps,
                  RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: sum = x + branch; out = norm(sum) * weight (+ bias)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    offs = row * n + cols
    total = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) + \
        tl.load(branch_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    total = total.to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + offs, total, mask=mask)
    s = total.to(tl.float32)
    if RMS:
        centred = s
    else:
        mean = tl.sum(s, 0) / n
        centred = tl.where(mask, s - mean, 0.0)
        tl.store(mean_ptr + row, mean)
    rstd = tl.rsqrt(tl.sum(centred * centred, 0) / n + eps)
    tl.store(rstd_ptr + row, rstd)
    normed = centred * rstd
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        out = normed.to(sum_ptr.dtype.element_ty).to(tl.float32) * weight
    else:
        out = normed * weight
        if HAS_BIAS:
            out += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_norm_bwd(grad_out_ptr, grad_sum_ptr, sum_ptr, weight_ptr, mean_ptr, rstd_ptr, grad_in_ptr,
                  grad_weight_ptr, grad_bias_ptr, rows, n, RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Program p takes rows p, p + programs, ...: the input gradient of each, and its own partial
    sums of the weight and bias gradients (row p of grad_weight_ptr / grad_bias_ptr)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    grad_weight = tl.zeros((BLOCK,), dtype=tl.float32)
    grad_bias = tl.zeros((BLOCK,), dtype=tl.float32)
    for row in range(pid.to(tl.int64), rows, programs):
        offs = row * n + cols
        dy = tl.load(grad_out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sum_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        if RMS:
            normed = s * rstd
            grad_weight += dy * normed.to(sum_ptr.dtype.element_ty).to(tl.float32)
        else:
            normed = tl.where(mask, (s - tl.load(mean_ptr + row)) * rstd, 0.0)
            grad_weight += dy * normed
            grad_bias += dy
        wdy = weight * dy
        c1 = tl.sum(normed * wdy, 0) / n
        if RMS:
            dx = (wdy - normed * c1) * rstd
        else:
            dx = (wdy - normed * c1 - tl.sum(wdy, 0) / n) * rstd
        dx += tl.load(grad_sum_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(grad_in_ptr + offs, dx.to(grad_in_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_weight_ptr + pid * n + cols, grad_weight, mask=mask)
    if HAS_BIAS:
        tl.store(grad_bias_ptr + pid * n + cols, grad_bias, mask=mask)


def _launch_shape(n: int) -> tuple[int, int]:
    """Columns a program holds (the whole row) and its warps: 16-byte accesses, about 8 per thread."""
    block = triton.next_power_of_2(n)
    return block, min(max(block // 1024, 4), 16)


class AddNorm(torch.autograd.Function):
    """(x + branch, norm(x + branch)) over the last dimension; LayerNorm, or RMSNorm with ``rms``."""

    @staticmethod
    def forward(ctx, x, branch, weight, bias: Optional[torch.Tensor], eps: float, rms: bool):
        n = x.shape[-1]
        rows = x.numel() // n
        total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        stats = torch.empty(2, rows, dtype=torch.float32, device=x.device)  # mean (LayerNorm), rstd
        block, warps = _launch_shape(n)
        _add_norm_fwd[(rows,)](x.contiguous(), branch.contiguous(), weight, bias, total, out, stats[0], stats[1],
                               n, eps, RMS=rms, HAS_BIAS=bias is not None, BLOCK=block, num_warps=warps)
        ctx.rms = rms
        ctx.save_for_backward(total, weight, bias, stats)
        return total, out

    @staticmethod
    def backward(ctx, grad_sum, grad_out):
        total, weight, bias, stats = ctx.saved_tensors
        n = total.shape[-1]
        rows = total.numel() // n
        programs = min(rows, 4 * torch.cuda.get_device_properties(total.device).multi_processor_count)
        grad_in = torch.empty_like(total)
        partial = torch.empty(2 if bias is not None else 1, programs, n, dtype=torch.float32, device=total.device)
        block, warps = _launch_shape(n)
        _add_norm_bwd[(programs,)](grad_out.contiguous(), grad_sum.contiguous(), total, weight, stats[0], stats[1],
                                   grad_in, partial[0], partial[-1], rows, n, RMS=ctx.rms,
                                   HAS_BIAS=bias is not None, BLOCK=block, num_warps=warps)
        sums = partial.sum(1)
        grad_bias = sums[1].to(bias.dtype) if bias is not None else None
        return grad_in, grad_in, sums[0].to(weight.dtype), grad_bias, None, None


def add_layer_norm(x: torch.Tensor, branch: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return AddNorm.apply(x, branch, weight, bias, eps, False)


def add_rms_norm(x: torch.Tensor, branch: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return AddNorm.apply(x, branch, weight, None, eps, True)
