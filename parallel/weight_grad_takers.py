"""Where a linear layer's backward sends its weight gradient when a schedule computes it later.

A split-backward (zero-bubble) pipeline schedule computes the weight gradients of its linears at ops
of their own (``parallel.pipeline.deferred_wgrad``). The linears are custom operators, so that a
compiled block keeps them inside its graph and still decides at run time, when the backward runs,
whether to defer. Custom operators take no Python objects: the queue registers itself here and the
operators are given its number (``weight_grads_to``); their backward calls ``hand_over`` with the
weight, the bias and the two factors of the weight gradient.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Optional, Protocol

import torch

IN_BACKWARD = -1
"""``weight_grads_to`` of a linear whose weight gradient its own backward computes."""

class WeightGradTaker(Protocol):
    def hand_over(self, weight: torch.Tensor, bias: Optional[torch.Tensor], x: torch.Tensor,
                  grad_out: torch.Tensor) -> None:
        """Take (or compute at once) the weight gradient ``sum dY^T X`` of ``weight`` (and ``bias``)."""


_TAKERS: dict[int, weakref.ref] = {}
_numbers = itertools.count()


def register_weight_grad_taker(taker: WeightGradTaker) -> int:
    """A number for ``weight_grads_to``: a backward given it calls ``taker.hand_over`` instead of
    computing the weight gradient. ``taker`` is held weakly and its entry goes with it."""
    number = next(_numbers)
    _TAKERS[number] = weakref.ref(taker)
    weakref.finalize(taker, _TAKERS.pop, number, None)
    return number


def hand_over(number: int, weight: torch.Tensor, bias: Optional[torch.Tensor], x: torch.Tensor,
              grad_out: torch.Tensor) -> None:
    """Give taker ``number`` a weight gradient's factors: the layer's input and output gradient."""
    _TAKERS[number]().hand_over(weight, bias, x, grad_out)


def keep_params(ctx, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
    """Keep an operator's ``weight`` and ``bias`` on ``ctx`` where they are the parameters themselves
    (eager), for ``saved_params``: ``hand_over`` delivers to the parameter, and under full recompute
    the tensors the operator saved come back from the forward run again in backward as detached
    copies (every linear raised TypeError under a split-backward schedule without torch.compile). A
    compiled graph is given the parameters when it runs, so there nothing is kept."""
    ctx.params = (weight, bias) if isinstance(weight, torch.nn.Parameter) else None


def saved_params(ctx, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> tuple:
    """The ``weight`` and ``bias`` an operator saved, as the parameters ``keep_params`` kept if it did."""
    return ctx.params or (weight, bias)


def deferral(ctx) -> int:
    """Where the backward of a custom operator given ``weight_grads_to`` (kept on ``ctx``) sends its
    weight gradient. Handed over, the weight gradient is no output of the operator, whose input gradient
    then keeps it in a compiled backward graph; without one (an input that needs no gradient) the graph
    would drop the operator, hand-over and all, so the weight gradient is computed in backward instead."""
    return ctx.weight_grads_to if ctx.needs_input_grad[0] else IN_BACKWARD
