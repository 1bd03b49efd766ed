"""Gradient reductions that follow a pipeline step, before the optimizer.

Two sums the schedule itself does not do:

- Tied embeddings: the first stage's token embedding and the last stage's LM head are copies of one
  matrix. Each copy received the gradient of its own use; the true gradient is their sum, so both
  copies get it (``sum_tied_grads``, which the data-parallel wrapper runs at every step, before its
  own reduction) and stay identical after the optimizer step.
- Data parallelism: every pipeline replica saw different samples; the gradient of the mean loss is
  the mean of theirs. ``allreduce_data_parallel_grads`` is the plain version; a ZeRO optimizer takes
  its place by reduce-scattering instead (``parallel.data_parallel``).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from parallel.comm import all_reduce_coalesced, group_size

GradReducer = Callable[[Iterable[nn.Parameter]], None]


def _grads(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def sum_tied_grads(grads: list[torch.Tensor], group) -> None:
    """Sum the gradients of the tied embedding copies on the first and last stages of the pipeline
    over their embedding ``group``, in place; with no group, both copies are on this rank (a V-shaped
    pipeline's first rank) and are summed here.

    Call it on every rank (ranks off those stages pass nothing and return at once).
    """
    if group is None:
        if len(grads) == 2:
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        elif grads:
            raise ValueError(f"{len(grads)} tied gradients on this rank and no group to sum them over")
        return
    if not grads or group_size(group) == 1:
        return
    all_reduce_coalesced(grads, group)


def allreduce_data_parallel_grads(params: Iterable[nn.Parameter], topo) -> None:
    """Average gradients over the data-parallel group (the plain, non-ZeRO reducer)."""
    if topo.dp_size == 1:
        return
    all_reduce_coalesced(_grads(params), topo.dp_group, scale=1.0 / topo.dp_size)
