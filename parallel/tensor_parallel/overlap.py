"""Sequence-parallel linears whose collectives run while their matrix products compute.

Under sequence parallelism a column-parallel linear all-gathers its input's tokens first and a
row-parallel one reduce-scatters its output's tokens after; composed from separate ops, every
collective waits for the product before it, or the product waits for it. Here each linear is one
autograd function that orders the work so that communication and computation overlap (the
collectives run on NCCL's stream while the products run on the compute stream):

========================  =================================================================
column forward            all-gather the tokens, meanwhile multiply this rank's own tokens;
                          then the other ranks' tokens
column backward           input gradient, then its reduce-scatter while the weight gradient
                          is computed
row forward               one reduce (to its owner) per rank's token chunk, each started as
                          soon as that chunk's product is done, while the next one computes
row backward              all-gather the output gradient's tokens, meanwhile the input
                          gradient of this rank's own tokens; then the rest and the weight
                          gradient
========================  =================================================================

Tokens are split as ``collectives`` splits them: ``[batch * seq]`` in memory order, rank ``r``
holding chunk ``r``. The results equal the composed form up to the order of floating-point sums
(tested on gloo against one process, and on GPUs against the composed layers).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from parallel import comm


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _gather_then_multiply(local: torch.Tensor, matrix: torch.Tensor, group,
                          bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(every rank's token rows of ``local`` gathered, those rows @ ``matrix`` (+ ``bias``)), with the
    gather overlapping the product of this rank's own rows."""
    size, rank = comm.group_size(group), dist.get_rank(group)
    rows = _rows(local)
    n = rows.shape[0]
    full = rows.new_empty((n * size, rows.shape[1]))
    handle = comm.all_gather_into(full, rows, group, async_op=True)
    out = rows.new_empty((n * size, matrix.shape[1]))

    def multiply(src: torch.Tensor, lo: int, hi: int) -> None:
        if hi > lo:
            if bias is None:
                torch.mm(src, matrix, out=out[lo:hi])
            else:
                torch.addmm(bias, src, matrix, out=out[lo:hi])

    multiply(rows, rank * n, (rank + 1) * n)
    handle.wait()
    multiply(full[:rank * n], 0, rank * n)
    multiply(full[(rank + 1) * n:], (rank + 1) * n, size * n)
    return full, out


def _token_shape(x: torch.Tensor, rows: int) -> tuple[int, ...]:
    """[batch, seq', ...] holding ``rows`` tokens of ``x``'s batch (the sequence scaled to fit)."""
    return (x.shape[0], rows // x.shape[0], *x.shape[2:-1])


class _ColumnLinear(torch.autograd.Function):
    """y = all-gather-tokens(x) @ weight^T + bias."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        full, y = _gather_then_multiply(x, weight.t(), group, bias)
        ctx.save_for_backward(full, weight)
        ctx.group, ctx.has_bias, ctx.x_shape = group, bias is not None, x.shape
        return y.view(*_token_shape(x, full.shape[0]), weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        full, weight = ctx.saved_tensors
        grad = _rows(grad_y)
        grad_full_x = grad @ weight
        grad_x = grad_full_x.new_empty(ctx.x_shape)
        handle = comm.reduce_scatter_into(grad_x.view(-1), grad_full_x.view(-1), ctx.group, async_op=True)
        grad_weight = grad.t() @ full
        grad_bias = grad.sum(0) if ctx.has_bias else None
        handle.wait()
        return grad_x, grad_weight, grad_bias, None


class _RowLinear(torch.autograd.Function):
    """y = reduce-scatter-tokens(x @ weight^T)."""

    @staticmethod
    def forward(ctx, x, weight, group):
        size, rank = comm.group_size(group), dist.get_rank(group)
        rows = _rows(x)
        n = rows.shape[0] // size
        parts, handles = [], []
        for owner in range(size):  # the same order on every rank: collectives never cross
            part = rows[owner * n:(owner + 1) * n] @ weight.t()
            handles.append(comm.reduce_to(part, owner, group, async_op=True))
            parts.append(part)
        for handle in handles:
            handle.wait()
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return parts[rank].view(*_token_shape(x, n), weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        full_grad, grad_x = _gather_then_multiply(grad_y, weight, ctx.group)
        grad_weight = full_grad.t() @ _rows(x)
        return grad_x.view(x.shape), grad_weight, None


def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group) -> torch.Tensor:
    """Column-parallel linear on sequence-parallel input [batch, seq/tp, in] -> [batch, seq, out/tp]."""
    return _ColumnLinear.apply(x, weight, bias, group)


def row_linear(x: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """Row-parallel linear [batch, seq, in/tp] -> this rank's tokens of the sum, [batch, seq/tp, out]."""
    return _RowLinear.apply(x, weight, group)
