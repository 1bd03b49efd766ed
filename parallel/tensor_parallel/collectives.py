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

import torch
import torch.distributed as dist

from parallel import comm


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    comm.all_reduce(x, group)
    return x


def _gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    size = comm.group_size(group)
    if size == 1:
        return x
    front = x.transpose(0, 1).contiguous()
    out = front.new_empty((front.shape[0] * size, *front.shape[1:]))
    comm.all_gather_into(out, front, group)
    return out.transpose(0, 1)


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    size = comm.group_size(group)
    if size == 1:
        return x
    front = x.transpose(0, 1).contiguous()
    if front.shape[0] % size:
        raise ValueError(f"sequence length {front.shape[0]} is not divisible by the tensor-parallel size {size}")
    out = front.new_empty((front.shape[0] // size, *front.shape[1:]))
    comm.reduce_scatter_into(out, front, group)
    return out.transpose(0, 1)


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    size = comm.group_size(group)
    if size == 1:
        return x
    front = x.movedim(-1, 0).contiguous()
    out = front.new_empty((front.shape[0] * size, *front.shape[1:]))
    comm.all_gather_into(out, front, group)
    return out.movedim(0, -1)


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    size = comm.group_size(group)
    if size == 1:
        return x
    if x.shape[-1] % size:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the tensor-parallel size {size}")
    return x.chunk(size, dim=-1)[dist.get_rank(group)].contiguous()


def _split_seq(x: torch.Tensor, group) -> torch.Tensor:
    size = comm.group_size(group)
    if size == 1:
        return x
    if x.shape[1] % size:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by the tensor-parallel size {size}")
    return x.chunk(size, dim=1)[dist.get_rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _SplitSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


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
