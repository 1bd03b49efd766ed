"""Collectives under stable names, whichever torch (2.11-2.14) is installed.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of
``all_gather_single`` / ``reduce_scatter_single``, which older releases lack; callers use the
functions here and never see the warning or the difference. Groups of one rank short-circuit, so a
tp=1 or dp=1 layout pays no communication.

A blocking collective that fails (a peer died, or the group's timeout passed while a peer never
arrived) raises ``CollectiveError`` naming this rank, the operation and the group (its kind, as the
topology described it, and its members): gloo's own message says only that a receive timed out.
"""

from __future__ import annotations

from typing import Optional

import contextlib

import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message says who, what and where."""


def describe_group(group: Optional[dist.ProcessGroup]) -> str:
    desc = getattr(group, "group_desc", None) or ("world" if group in (None, dist.group.WORLD) else "group")
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
    return f"{desc} group of {len(ranks)} ranks [{shown}]"


@contextlib.contextmanager
def named(op: str, group, async_op: bool = False):
    """Re-raise a blocking collective's failure with the rank, operation and group in the message."""
    if async_op:  # failures surface at wait(), in the caller
        yield
        return
    try:
        yield
    except (RuntimeError, dist.DistError) as exc:
        raise CollectiveError(f"rank {dist.get_rank()}: {op} on the {describe_group(group)} failed: {exc}") from exc


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group)


def group_named(name: str) -> dist.ProcessGroup:
    """The process group of ``group.group_name`` (how custom ops, which take no group objects, get one)."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(name)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool = False):
    """Concatenate every rank's equal-sized ``shard`` along dim 0 into ``output``."""
    if group_size(group) == 1:
        if shard.data_ptr() != output.data_ptr():  # in place (ZeRO's own slice) is already done
            output.copy_(shard.reshape(output.shape))
        return None
    with named("all_gather", group, async_op):
        return _all_gather_single(output, shard.contiguous(), group=group, async_op=async_op)


def reduce_scatter_into(output: torch.Tensor, full: torch.Tensor, group, op=dist.ReduceOp.SUM,
                        async_op: bool = False):
    """Sum ``full`` over the group and keep this rank's dim-0 slice in ``output``."""
    if group_size(group) == 1:
        output.copy_(full.reshape(output.shape))
        return None
    with named("reduce_scatter", group, async_op):
        return _reduce_scatter_single(output, full.contiguous(), op=op, group=group, async_op=async_op)


def reduce_to(tensor: torch.Tensor, dst: int, group, async_op: bool = False):
    """Sum ``tensor`` over the group into the copy on group rank ``dst`` (what the other ranks' copies
    hold afterwards depends on the backend: treat them as spent)."""
    if group_size(group) == 1:
        return None
    with named("reduce", group, async_op):
        return dist.reduce(tensor, dst=dist.get_global_rank(group, dst), group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
    if group_size(group) == 1:
        return None
    with named("all_reduce", group, async_op):
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_reduce_coalesced(tensors: list[torch.Tensor], group, scale: float = 1.0) -> None:
    """Sum ``tensors`` over ``group`` in place (then times ``scale``) with one collective per dtype
    over a flattened copy: many small gradients (norms, biases) cost one launch and one latency."""
    if group_size(group) == 1 and scale == 1.0:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        if len(same) == 1 and scale == 1.0:  # in place: no flat copy of a large embedding gradient
            all_reduce(same[0], group)
            continue
        flat = torch.cat([t.reshape(-1) for t in same])
        all_reduce(flat, group)
        if scale != 1.0:
            flat.mul_(scale)
        for t, part in zip(same, flat.split([t.numel() for t in same])):
            t.copy_(part.view_as(t))
