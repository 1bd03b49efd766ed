"""The tensor-parallel collectives as autograd functions: each one and its mirror in backward.

| function                  | forward                         | backward                      |
|---------------------------|---------------------------------|-------------------------------|
| copy_to_tp                | identity                        | all-reduce                    |
| reduce_from_tp            | all-reduce                      | identity                      |
| scatter_to_tp             | keep this rank's last-dim slice | all-gather along the last dim |
| gather_from_tp            | all-gather along the last dim   | keep this rank's slice        |
| split_sequence            | keep this rank's sequence slice | all-gather along the sequence |
| gather_sequence           | all-gather along the sequence   | reduce-scatter                |
| reduce_scatter_sequence   | reduce-scatter along sequence   | all-gather                    |

Activations are ``[batch, seq, ...]``; the sequence is dim 1. The communication shim works on
dim 0, so sequence collectives move the sequence to the front first; with micro-batch 1 that move
is free (no copy). All of them are identities on a group of one rank.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from parallel import comm


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    comm.all_reduce(x, group)
    return x


def _check_divisible(x: torch.Tensor, dim: int, size: int) -> None:
    if x.shape[dim] % size:
        what = "sequence length" if dim == 1 else f"dimension {dim}"
        raise ValueError(f"{what} {x.shape[dim]} is not divisible by the tensor-parallel size {size}")


def _gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``."""
    size = comm.group_size(group)
    if size == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] * size, *front.shape[1:]))
    comm.all_gather_into(out, front, group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's part along ``dim``."""
    size = comm.group_size(group)
    if size == 1:
        return x
    _check_divisible(x, dim, size)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // size, *front.shape[1:]))
    comm.reduce_scatter_into(out, front, group)
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


SEQ, LAST = 1, -1
_CopyToTP = _mirrored("_CopyToTP", lambda x, g: x.view_as(x), _all_reduce)
_ReduceFromTP = _mirrored("_ReduceFromTP", lambda x, g: _all_reduce(x.clone(), g), lambda grad, g: grad)
_ScatterToTP = _mirrored("_ScatterToTP", lambda x, g: _split(x, g, LAST), lambda grad, g: _gather(grad, g, LAST))
_GatherFromTP = _mirrored("_GatherFromTP", lambda x, g: _gather(x, g, LAST), lambda grad, g: _split(grad, g, LAST))
_SplitSequence = _mirrored("_SplitSequence", lambda x, g: _split(x, g, SEQ), lambda grad, g: _gather(grad, g, SEQ))
_GatherSequence = _mirrored("_GatherSequence", lambda x, g: _gather(x, g, SEQ),
                            lambda grad, g: _reduce_scatter(grad, g, SEQ))
_ReduceScatterSequence = _mirrored("_ReduceScatterSequence", lambda x, g: _reduce_scatter(x, g, SEQ),
                                   lambda grad, g: _gather(grad, g, SEQ))


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
    """Replicated [batch, seq, ...] -> this rank's [batch, seq/tp, ...] slice."""
    return _SplitSequence.apply(x, group)


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Sequence slices -> the full sequence on every rank (sequence-parallel region -> tensor-parallel)."""
    return _GatherSequence.apply(x, group)


def reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Partial sums over the full sequence -> this rank's slice of the total (tensor-parallel -> sequence)."""
    return _ReduceScatterSequence.apply(x, group)
