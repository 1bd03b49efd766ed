"""Sequence-parallel linears whose collectives run while their matrix products compute.

Under sequence parallelism a column-parallel linear all-gathers its input's tokens first and a
row-parallel one reduce-scatters its output's tokens after; composed from separate ops, every
collective waits for the product before it, or the product waits for it. Here each linear is one
operator, forward and backward, that orders the work so that communication and computation overlap
(the collectives run on NCCL's stream while the products run on the compute stream):

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
from parallel.tensor_parallel.collectives import token_shape


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
    if handle is not None:
        handle.wait()
    multiply(full[:rank * n], 0, rank * n)
    multiply(full[(rank + 1) * n:], (rank + 1) * n, size * n)
    return full, out


def _shaped_like(x: torch.Tensor, rows: int, features: int) -> tuple[int, ...]:
    """``rows`` tokens of ``features`` each, laid out like ``x`` [batch, seq, ...]."""
    return (*token_shape(x, rows)[:-1], features)


# Each linear is a custom op (forward and backward each one op, the backward registered as the
# forward's autograd formula): torch.compile keeps it whole inside a block's graph, where an
# asynchronous collective and its wait would each split the graph, and every split costs host time
# on every call. The process group travels as its name, the one argument type ops accept for it.

@torch.library.custom_op("megazero::sp_column_linear", mutates_args=())
def _column(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
            group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(all-gather-tokens(x) @ weight^T + bias, the gathered token rows kept for backward)."""
    full, y = _gather_then_multiply(x, weight.t(), comm.group_named(group_name), bias)
    return y.view(_shaped_like(x, full.shape[0], weight.shape[0])), full


@_column.register_fake
def _(x, weight, bias, group_name):
    rows = x.numel() // x.shape[-1] * comm.group_size(comm.group_named(group_name))
    return x.new_empty(_shaped_like(x, rows, weight.shape[0])), x.new_empty((rows, x.shape[-1]))


@torch.library.custom_op("megazero::sp_column_linear_backward", mutates_args=())
def _column_backward(grad_y: torch.Tensor, full: torch.Tensor, weight: torch.Tensor, has_bias: bool,
                     group_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad x, grad weight, grad bias or an empty tensor): the input gradient's reduce-scatter runs
    while the weight gradient is computed."""
    grad = _rows(grad_y)
    grad_full_x = grad @ weight
    size = comm.group_size(comm.group_named(group_name))
    grad_x = grad_full_x.new_empty(_shaped_like(grad_y, grad.shape[0] // size, weight.shape[1]))
    handle = comm.reduce_scatter_into(grad_x.view(-1), grad_full_x.view(-1), comm.group_named(group_name),
                                      async_op=True)
    grad_weight = grad.t() @ full
    grad_bias = grad.sum(0) if has_bias else grad.new_empty(0)
    if handle is not None:
        handle.wait()
    return grad_x, grad_weight, grad_bias


@_column_backward.register_fake
def _(grad_y, full, weight, has_bias, group_name):
    size = comm.group_size(comm.group_named(group_name))
    rows = grad_y.numel() // grad_y.shape[-1] // size
    return (grad_y.new_empty(_shaped_like(grad_y, rows, weight.shape[1])), torch.empty_like(weight),
            grad_y.new_empty(weight.shape[0] if has_bias else 0))


def _column_setup(ctx, inputs, output):
    x, weight, bias, group_name = inputs
    ctx.save_for_backward(output[1], weight)
    ctx.has_bias, ctx.group_name = bias is not None, group_name


def _column_grad(ctx, grad_y, _grad_full):
    full, weight = ctx.saved_tensors
    grad_x, grad_weight, grad_bias = _column_backward(grad_y, full, weight, ctx.has_bias, ctx.group_name)
    return grad_x, grad_weight, grad_bias if ctx.has_bias else None, None


_column.register_autograd(_column_grad, setup_context=_column_setup)


@torch.library.custom_op("megazero::sp_row_linear", mutates_args=())
def _row(x: torch.Tensor, weight: torch.Tensor, group_name: str) -> torch.Tensor:
    """reduce-scatter-tokens(x @ weight^T): one reduce per owner's token chunk, started as soon as
    that chunk's product is done."""
    group = comm.group_named(group_name)
    size, rank = comm.group_size(group), dist.get_rank(group)
    rows = _rows(x)
    if rows.shape[0] % size:
        raise ValueError(f"{rows.shape[0]} tokens do not split into {size} equal sequence-parallel chunks")
    n = rows.shape[0] // size
    parts, handles = [], []
    for owner in range(size):  # the same order on every rank: collectives never cross
        part = rows[owner * n:(owner + 1) * n] @ weight.t()
        handles.append(comm.reduce_to(part, owner, group, async_op=True))
        parts.append(part)
    for handle in handles:
        if handle is not None:
            handle.wait()
    return parts[rank].view(_shaped_like(x, n, weight.shape[0]))


@_row.register_fake
def _(x, weight, group_name):
    rows = x.numel() // x.shape[-1] // comm.group_size(comm.group_named(group_name))
    return x.new_empty(_shaped_like(x, rows, weight.shape[0]))


@torch.library.custom_op("megazero::sp_row_linear_backward", mutates_args=())
def _row_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                  group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad x, grad weight): the output gradient's all-gather runs while this rank's own tokens'
    input gradient is computed."""
    full_grad, grad_x = _gather_then_multiply(grad_y, weight, comm.group_named(group_name))
    return grad_x.view(x.shape), full_grad.t() @ _rows(x)


@_row_backward.register_fake
def _(grad_y, x, weight, group_name):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _row_setup(ctx, inputs, output):
    x, weight, group_name = inputs
    ctx.save_for_backward(x, weight)
    ctx.group_name = group_name


def _row_grad(ctx, grad_y):
    x, weight = ctx.saved_tensors
    grad_x, grad_weight = _row_backward(grad_y, x, weight, ctx.group_name)
    return grad_x, grad_weight, None


_row.register_autograd(_row_grad, setup_context=_row_setup)


def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group) -> torch.Tensor:
    """Column-parallel linear on sequence-parallel input [batch, seq/tp, in] -> [batch, seq, out/tp]."""
    return _column(x, weight, bias, group.group_name)[0]


def row_linear(x: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """Row-parallel linear [batch, seq, in/tp] -> this rank's tokens of the sum, [batch, seq/tp, out]."""
    return _row(x, weight, group.group_name)
