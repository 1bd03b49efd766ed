"""The tensor-parallel collectives as autograd functions: each one and its mirror in backward.

| function                  | forward                         | backward                      |
|---------------------------|---------------------------------|-------------------------------|
| copy_to_tp                | identity                        | all-reduce                    |
| reduce_from_tp            | all-reduce                      | identity                      |
| scatter_to_tp             | keep this rank's last-dim slice | all-gather along the last dim |
| gather_from_tp            | all-gather along the last dim   | keep this rank's slice        |
| split_sequence            | keep this rank's token slice    | all-gather the tokens         |
| gather_sequence           | all-gather the tokens           | reduce-scatter                |
| reduce_scatter_sequence   | reduce-scatter the tokens       | all-gather                    |

Activations are ``[batch, seq, ...]``. Sequence parallelism splits the tokens, and what runs on a
rank's slice (norms, dropout, residual adds, biases) treats every token alike, so *which* tokens a
rank holds is free to choose as long as the three sequence collectives agree. They split the
tokens in memory order, ``[batch * seq]`` in ``tp`` contiguous chunks, and give each rank's chunk
the shape ``[batch, seq / tp, ...]``: with micro-batch 1 that is the sequence slice, with more it
mixes sequences, and no collective ever copies its input into another layout (moving the sequence
to the front for micro-batch 8 cost a copy of every 64 MiB activation on both sides of each
collective). All of them are identities on a group of one rank.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from parallel import comm


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``x`` over ``group``, in a new tensor (``x`` is left as it was)."""
    return _summed(x, group.group_name)


# An operator of its own, opaque to torch.compile. Traced as an in-place ``dist.all_reduce`` (of a
# clone in forward, of the incoming gradient in backward), these sums compiled to wrong gradients
# on CUDA with torch 2.11: a tp-2 block without sequence parallelism gave many of its weights zero
# gradients, with the right loss. The same code compiled for the CPU, and eager on either, was
# right; the sequence-parallel collectives, which write into new tensors, were right too.
@torch.library.custom_op("megazero::tp_all_reduce", mutates_args=())
def _summed(x: torch.Tensor, group_name: str) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, comm.group_named(group_name))
    return out


@_summed.register_fake
def _(x, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _check_divisible(x: torch.Tensor, dim: int, size: int) -> None:
    if x.shape[dim] % size:
        what = "sequence length" if dim == 1 else f"dimension {dim}"
        raise ValueError(f"{what} {x.shape[dim]} is not divisible by the tensor-parallel size {size}")


def token_shape(x: torch.Tensor, tokens: int) -> tuple[int, ...]:
    """The shape of ``tokens`` tokens laid out like ``x`` [batch, seq, ...]: [batch, tokens / batch, ...]
    (one rank's token chunk, or every rank's)."""
    return (x.shape[0], tokens // x.shape[0], *x.shape[2:])


def _gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's token chunk, in rank order: [batch, seq/tp, ...] -> [batch, seq, ...]."""
    size = comm.group_size(group)
    if size == 1:
        return x
    out = x.new_empty(token_shape(x, x.shape[0] * x.shape[1] * size))
    comm.all_gather_into(out.view(-1), x.contiguous().view(-1), group)
    return out


def _reduce_scatter_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over ranks of ``x`` [batch, seq, ...], keeping this rank's token chunk."""
    size = comm.group_size(group)
    if size == 1:
        return x
    _check_divisible(x, 1, size)
    out = x.new_empty(token_shape(x, x.shape[0] * x.shape[1] // size))
    comm.reduce_scatter_into(out.view(-1), x.contiguous().view(-1), group)
    return out


def _split_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's token chunk of a replicated ``x`` (no communication; a copy, so that the whole
    replicated tensor is not kept alive by the chunk until backward)."""
    size = comm.group_size(group)
    if size == 1:
        return x
    _check_divisible(x, 1, size)
    chunk = x.contiguous().view(-1).chunk(size)[dist.get_rank(group)]
    return chunk.view(token_shape(x, x.shape[0] * x.shape[1] // size)).clone()


def _gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``."""
    size = comm.group_size(group)
    if size == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] * size, *front.shape[1:]))
    comm.all_gather_into(out, front, group)
    return out.movedim(0, dim)


def _split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's part of a replicated ``x`` along ``dim`` (no communication)."""
    size = comm.group_size(group)
    if size == 1:
        return x
    _check_divisible(x, dim, size)
    return x.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


def _mirrored(name: str, forward: Callable, backward: Callable) -> type:
    """An autograd function that runs ``forward(x, group)`` and, in backward, ``backward(grad, group)``."""

    def fwd(ctx, x, group):
        ctx.group = group
        return forward(x, group)

    def bwd(ctx, grad):
        return backward(grad, ctx.group), None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


LAST = -1
_CopyToTP = _mirrored("_CopyToTP", lambda x, g: x.view_as(x), _all_reduce)
_ReduceFromTP = _mirrored("_ReduceFromTP", _all_reduce, lambda grad, g: grad)
_ScatterToTP = _mirrored("_ScatterToTP", lambda x, g: _split(x, g, LAST), lambda grad, g: _gather(grad, g, LAST))
_GatherFromTP = _mirrored("_GatherFromTP", lambda x, g: _gather(x, g, LAST), lambda grad, g: _split(grad, g, LAST))
_SplitSequence = _mirrored("_SplitSequence", _split_tokens, _gather_tokens)
_GatherSequence = _mirrored("_GatherSequence", _gather_tokens, _reduce_scatter_tokens)
_ReduceScatterSequence = _mirrored("_ReduceScatterSequence", _reduce_scatter_tokens, _gather_tokens)


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a region where each rank uses ``x`` for its own shard: sum the gradients on the way back."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a sharded region by summing the ranks' partial results."""
    return _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Replicated [..., n] -> this rank's [..., n/tp] slice (e.g. to feed a row-parallel layer)."""
    return _ScatterToTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Last-dim slices -> the whole tensor on every rank (e.g. full logits for generation or evaluation).

    Backward keeps this rank's slice of the gradient: whatever follows must be replicated across tp.
    """
    return _GatherFromTP.apply(x, group)


def split_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Replicated [batch, seq, ...] -> this rank's [batch, seq/tp, ...] token chunk."""
    return _SplitSequence.apply(x, group)


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Token chunks -> the full sequence on every rank (sequence-parallel region -> tensor-parallel)."""
    return _GatherSequence.apply(x, group)


def reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Partial sums over the full sequence -> this rank's token chunk of the total (tensor-parallel -> sequence)."""
    return _ReduceScatterSequence.apply(x, group)
