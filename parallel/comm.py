"""Collectives under stable names, whichever torch (2.11-2.14) is installed.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of
``all_gather_single`` / ``reduce_scatter_single``, which older releases lack; callers use the
functions here and never see the warning or the difference. Groups of one rank short-circuit, so a
tp=1 or dp=1 layout pays no communication.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool = False):
    """Concatenate every rank's equal-sized ``shard`` along dim 0 into ``output``."""
    if group_size(group) == 1:
        output.copy_(shard.reshape(output.shape))
        return None
    return _all_gather_single(output, shard.contiguous(), group=group, async_op=async_op)


def reduce_scatter_into(output: torch.Tensor, full: torch.Tensor, group, op=dist.ReduceOp.SUM,
                        async_op: bool = False):
    """Sum ``full`` over the group and keep this rank's dim-0 slice in ``output``."""
    if group_size(group) == 1:
        output.copy_(full.reshape(output.shape))
        return None
    return _reduce_scatter_single(output, full.contiguous(), op=op, group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
    if group_size(group) == 1:
        return None
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
