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
from typing import Callable, Optional

import torch

IN_BACKWARD = -1
"""``weight_grads_to`` of a linear whose weight gradient its own backward computes."""

_TAKERS: dict[int, tuple[weakref.ref, Callable]] = {}
_numbers = itertools.count()


def register_weight_grad_taker(owner: object, method: Callable[..., None]) -> int:
    """A number for ``weight_grads_to``: a backward given it calls ``method(owner, weight, bias, x,
    grad_out)`` instead of computing the weight gradient. ``owner`` is held weakly and its entry goes
    with it."""
    number = next(_numbers)
    _TAKERS[number] = (weakref.ref(owner), method)
    weakref.finalize(owner, _TAKERS.pop, number, None)
    return number


def hand_over(number: int, weight: torch.Tensor, bias: Optional[torch.Tensor], x: torch.Tensor,
              grad_out: torch.Tensor) -> None:
    """Give taker ``number`` a weight gradient's factors: the layer's input and output gradient."""
    owner, method = _TAKERS[number]
    method(owner(), weight, bias, x, grad_out)


def deferral(ctx) -> int:
    """Where the backward of a custom operator given ``weight_grads_to`` (kept on ``ctx``) sends its
    weight gradient. Handed over, the weight gradient is no output of the operator, whose input gradient
    then keeps it in a compiled backward graph; without one (an input that needs no gradient) the graph
    would drop the operator, hand-over and all, so the weight gradient is computed in backward instead."""
    return ctx.weight_grads_to if ctx.needs_input_grad[0] else IN_BACKWARD
