"""Sequence-parallel linears as single operators, in one of three communication modes.

Under sequence parallelism a column-parallel linear all-gathers its input's tokens first and a
row-parallel one reduce-scatters its output's tokens after. Here each linear is one operator,
forward and backward (so a compiled block keeps it inside one graph), and ``mode`` (``MODES``) says
how its collectives meet its products. ``serial``: the collective, then one product (or the
reverse). ``overlap`` orders the work so that communication and computation overlap, the
collectives running on NCCL's stream while the products run on the compute stream; ``peer_memory``
does the same with the copy engines moving the tokens (``peer_memory``). The overlapped order:

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

A zero-bubble schedule computes the weight gradients later. Given ``weight_grads_to``, the number of
a taker (``parallel.weight_grad_takers``: the pipeline's ``WeightGradQueue``), a backward hands that
gradient's factors over at run time instead, from inside the compiled graph (the column backward's
reduce-scatter then has nothing to hide behind). Tokens are split as ``collectives`` splits them:
``[batch * seq]`` in memory order, rank ``r`` holding chunk ``r``. The results equal the composed
form up to the order of floating-point sums (``serial`` and ``overlap`` tested on gloo against one
process; every mode on GPUs against the composed layers).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from parallel import comm
from parallel.weight_grad_takers import IN_BACKWARD, deferral, hand_over, keep_params, saved_params
from parallel.tensor_parallel import peer_memory as peer_memory_ops
from parallel.tensor_parallel.collectives import token_shape


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


MODES = ("serial", "overlap", "peer_memory")
"""How the linears communicate: ``serial`` (NCCL collective, then the product, or the reverse),
``overlap`` (NCCL collectives beside the products), ``peer_memory`` (the copy engines through
``peer_memory``, beside the products)."""


def _check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"tensor-parallel communication {mode!r}: use one of {MODES}")
    return mode


def start_gather(full: torch.Tensor, rows: torch.Tensor, group_name: str, mode: str):
    """Start gathering every rank's token ``rows`` [n, h] into ``full`` [size * n, h]; returns the work
    to wait on (None when it already ran)."""
    if _check_mode(mode) == "peer_memory":
        return peer_memory_ops.all_gather(full, rows, group_name)
    return comm.all_gather_into(full, rows, comm.group_named(group_name), async_op=True)


def _gather_then_multiply(local: torch.Tensor, matrix: torch.Tensor, group_name: str, mode: str,
                          bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(every rank's token rows of ``local`` gathered, those rows @ ``matrix`` (+ ``bias``)); unless
    ``serial``, the gather overlaps the product of this rank's own rows."""
    group = comm.group_named(group_name)
    size, rank = comm.group_size(group), dist.get_rank(group)
    rows = _rows(local).contiguous()
    n = rows.shape[0]
    full = rows.new_empty((n * size, rows.shape[1]))
    handle = start_gather(full, rows, group_name, mode)
    out = rows.new_empty((n * size, matrix.shape[1]))

    def multiply(src: torch.Tensor, lo: int, hi: int) -> None:
        if hi > lo:
            if bias is None:
                torch.mm(src, matrix, out=out[lo:hi])
            else:
                torch.addmm(bias, src, matrix, out=out[lo:hi])

    if mode == "serial":
        _wait(handle)
        multiply(full, 0, size * n)
        return full, out
    multiply(rows, rank * n, (rank + 1) * n)
    _wait(handle)
    multiply(full[:rank * n], 0, rank * n)
    multiply(full[(rank + 1) * n:], (rank + 1) * n, size * n)
    return full, out


def _wait(handle) -> None:
    if handle is not None:  # None: the collective ran synchronously (one rank, or gloo)
        handle.wait()


def _start_reduce_scatter(full: torch.Tensor, shape: tuple[int, ...], group_name: str, mode: str):
    """(a tensor of ``shape`` that will hold this rank's token chunk of the sum of every rank's
    ``full`` [size * n, h], the work to wait on before reading it)."""
    group = comm.group_named(group_name)
    size, rank = comm.group_size(group), dist.get_rank(group)
    if _check_mode(mode) != "peer_memory":
        out = full.new_empty(shape)
        return out, comm.reduce_scatter_into(out.view(-1), full.view(-1), group, async_op=True)
    chunks = full.view(size, -1, full.shape[-1])
    summed, handle = _peer_chunk_sum(lambda owner: chunks[owner], chunks.shape[1:], full.dtype, group_name,
                                     size, rank)
    return summed.view(shape), handle


def _peer_chunk_sum(part_of, shape: torch.Size, dtype: torch.dtype, group_name: str, size: int, rank: int):
    """Reduce-scatter through peer memory of the token chunks ``part_of(owner)`` (each computed when
    asked for, so a chunk travels while the next one computes): the owners after this rank first,
    its own chunk last. Returns (this rank's sum, the work to wait on)."""
    total = peer_memory_ops.ChunkSum(shape, dtype, group_name, size)
    for step in range(1, size):
        owner = (rank + step) % size
        total.push(part_of(owner), owner)
    return total.finish(part_of(rank))


def _shaped_like(x: torch.Tensor, rows: int, features: int) -> tuple[int, ...]:
    """``rows`` tokens of ``features`` each, laid out like ``x`` [batch, seq, ...]."""
    return (*token_shape(x, rows)[:-1], features)


# Each linear is a custom op (forward and backward each one op, the backward registered as the
# forward's autograd formula): torch.compile keeps it whole inside a block's graph, where an
# asynchronous collective and its wait would each split the graph, and every split costs host time
# on every call. The process group travels as its name, the one argument type ops accept for it.

@torch.library.custom_op("megazero::sp_column_linear", mutates_args=())
def _column(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group_name: str,
            mode: str, weight_grads_to: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(all-gather-tokens(x) @ weight^T + bias, the gathered token rows kept for backward)."""
    full, y = _gather_then_multiply(x, weight.t(), group_name, mode, bias)
    return y.view(_shaped_like(x, full.shape[0], weight.shape[0])), full


@_column.register_fake
def _(x, weight, bias, group_name, mode, weight_grads_to):
    rows = x.numel() // x.shape[-1] * comm.group_size(comm.group_named(group_name))
    return x.new_empty(_shaped_like(x, rows, weight.shape[0])), x.new_empty((rows, x.shape[-1]))


@torch.library.custom_op("megazero::sp_column_linear_backward", mutates_args=())
def _column_backward(grad_y: torch.Tensor, full: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     group_name: str, mode: str,
                     weight_grads_to: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad x, grad weight, grad bias): the input gradient's reduce-scatter runs while the weight
    gradient is computed. With ``weight_grads_to`` a taker's number the weight and bias gradients'
    factors go to it instead (the reduce-scatter then has nothing to hide behind); missing gradients
    are empty tensors."""
    grad = _rows(grad_y)
    size = comm.group_size(comm.group_named(group_name))
    grad_x, handle = _start_reduce_scatter(grad @ weight, _shaped_like(grad_y, grad.shape[0] // size, weight.shape[1]),
                                           group_name, mode)
    if mode == "serial":
        _wait(handle)
        handle = None
    here = weight_grads_to == IN_BACKWARD
    grad_weight = grad.t() @ full if here else grad.new_empty(0)
    grad_bias = grad.sum(0) if bias is not None and here else grad.new_empty(0)
    if not here:
        hand_over(weight_grads_to, weight, bias, full, grad_y)
    _wait(handle)
    return grad_x, grad_weight, grad_bias


@_column_backward.register_fake
def _(grad_y, full, weight, bias, group_name, mode, weight_grads_to):
    size = comm.group_size(comm.group_named(group_name))
    rows = grad_y.numel() // grad_y.shape[-1] // size
    here = weight_grads_to == IN_BACKWARD
    return (grad_y.new_empty(_shaped_like(grad_y, rows, weight.shape[1])),
            torch.empty_like(weight) if here else grad_y.new_empty(0),
            grad_y.new_empty(weight.shape[0] if bias is not None and here else 0))


def _column_setup(ctx, inputs, output):
    x, weight, bias, group_name, mode, weight_grads_to = inputs
    ctx.save_for_backward(output[1], weight, bias)
    ctx.group_name, ctx.mode, ctx.weight_grads_to = group_name, mode, weight_grads_to
    keep_params(ctx, weight, bias)


def _column_grad(ctx, grad_y, _grad_full):
    full, weight, bias = ctx.saved_tensors
    weight, bias = saved_params(ctx, weight, bias)
    to = deferral(ctx)
    grad_x, grad_weight, grad_bias = _column_backward(grad_y, full, weight, bias, ctx.group_name, ctx.mode, to)
    if to != IN_BACKWARD:
        return grad_x, None, None, None, None, None
    return grad_x, grad_weight, grad_bias if bias is not None else None, None, None, None


_column.register_autograd(_column_grad, setup_context=_column_setup)


def _reduce_chunks_nccl(rows: torch.Tensor, weight: torch.Tensor, group, size: int, rank: int) -> torch.Tensor:
    n = rows.shape[0] // size
    parts, handles = [], []
    for owner in range(size):  # the same order on every rank: collectives never cross
        part = rows[owner * n:(owner + 1) * n] @ weight.t()
        handles.append(comm.reduce_to(part, owner, group, async_op=True))
        parts.append(part)
    for handle in handles:
        _wait(handle)
    return parts[rank]


def _reduce_chunks_peer(rows: torch.Tensor, weight: torch.Tensor, group_name: str, size: int,
                        rank: int) -> torch.Tensor:
    n = rows.shape[0] // size
    summed, handle = _peer_chunk_sum(lambda owner: rows[owner * n:(owner + 1) * n] @ weight.t(),
                                     torch.Size((n, weight.shape[0])), rows.dtype, group_name, size, rank)
    handle.wait()
    return summed


@torch.library.custom_op("megazero::sp_row_linear", mutates_args=())
def _row(x: torch.Tensor, weight: torch.Tensor, group_name: str, mode: str, weight_grads_to: int) -> torch.Tensor:
    """reduce-scatter-tokens(x @ weight^T); unless ``serial``, each owner's token chunk is sent on its
    way as soon as its product is done, while the next one computes."""
    group = comm.group_named(group_name)
    size, rank = comm.group_size(group), dist.get_rank(group)
    rows = _rows(x)
    if rows.shape[0] % size:
        raise ValueError(f"{rows.shape[0]} tokens do not split into {size} equal sequence-parallel chunks")
    if _check_mode(mode) == "peer_memory":
        mine = _reduce_chunks_peer(rows, weight, group_name, size, rank)
    elif mode == "overlap":
        mine = _reduce_chunks_nccl(rows, weight, group, size, rank)
    else:
        mine, handle = _start_reduce_scatter(rows @ weight.t(), (rows.shape[0] // size, weight.shape[0]), group_name,
                                             mode)
        _wait(handle)
    return mine.view(_shaped_like(x, rows.shape[0] // size, weight.shape[0]))


@_row.register_fake
def _(x, weight, group_name, mode, weight_grads_to):
    rows = x.numel() // x.shape[-1] // comm.group_size(comm.group_named(group_name))
    return x.new_empty(_shaped_like(x, rows, weight.shape[0]))


@torch.library.custom_op("megazero::sp_row_linear_backward", mutates_args=())
def _row_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, group_name: str,
                  mode: str, weight_grads_to: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad x, grad weight, or an empty tensor when ``weight_grads_to`` names a taker, which gets the
    weight gradient's factors: this rank's input and the gathered output gradient [tokens, out]):
    unless ``serial``, the output gradient's all-gather runs while this rank's own tokens' input
    gradient is computed."""
    full_grad, grad_x = _gather_then_multiply(grad_y, weight, group_name, mode)
    if weight_grads_to == IN_BACKWARD:
        return grad_x.view(x.shape), full_grad.t() @ _rows(x)
    hand_over(weight_grads_to, weight, None, x, full_grad)
    return grad_x.view(x.shape), full_grad.new_empty(0)


@_row_backward.register_fake
def _(grad_y, x, weight, group_name, mode, weight_grads_to):
    return x.new_empty(x.shape), weight.new_empty(weight.shape if weight_grads_to == IN_BACKWARD else 0)


def _row_setup(ctx, inputs, output):
    x, weight, group_name, mode, weight_grads_to = inputs
    ctx.save_for_backward(x, weight)
    ctx.group_name, ctx.mode, ctx.weight_grads_to = group_name, mode, weight_grads_to
    keep_params(ctx, weight)


def _row_grad(ctx, grad_y):
    x, weight = ctx.saved_tensors
    weight, _ = saved_params(ctx, weight)
    to = deferral(ctx)
    grad_x, grad_weight = _row_backward(grad_y, x, weight, ctx.group_name, ctx.mode, to)
    return grad_x, grad_weight if to == IN_BACKWARD else None, None, None, None


_row.register_autograd(_row_grad, setup_context=_row_setup)


def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group,
                  mode: str = "overlap", weight_grads_to: int = IN_BACKWARD) -> torch.Tensor:
    """Column-parallel linear on sequence-parallel input [batch, seq/tp, in] -> [batch, seq, out/tp],
    communicating as ``mode`` (one of ``MODES``) says; ``weight_grads_to``: see ``_column_backward``."""
    return _column(x, weight, bias, group.group_name, mode, weight_grads_to)[0]


def row_linear(x: torch.Tensor, weight: torch.Tensor, group, mode: str = "overlap",
               weight_grads_to: int = IN_BACKWARD) -> torch.Tensor:
    """Row-parallel linear [batch, seq, in/tp] -> this rank's tokens of the sum, [batch, seq/tp, out];
    ``weight_grads_to``: see ``_row_backward``."""
    return _row(x, weight, group.group_name, mode, weight_grads_to)
