"""Weight gradients held back from backward, for the split-backward (zero-bubble) schedules.

A linear layer's backward is two GEMMs: the input gradient ``dX = dY W``, which the previous pipeline
stage waits for, and the weight gradient ``dW = dY^T X``, which nothing waits for until the optimizer
step. ``WeightGradQueue.linear`` computes the first in backward and queues what the second needs
(its input and output gradient, kept alive until then); the executor runs the queue at the
schedule's ``W`` op for that micro-batch. The linear's bias moves with its weight: its gradient is a
sum of ``dY`` over the tokens, which ``W`` computes on its own (a GEMV ``1^T dY`` where the sink below
takes it, else a plain reduction), whereas left in ``B`` torch.compile fused it into the activation's
backward as a reduction kernel three times slower than that kernel alone (1.3B GPT on H100,
BENCHMARKS.md). Everything else in the model (norms, embeddings, attention itself) still gets its
gradient in ``B``: only the linears move.

The deferred ``dW`` reaches ``param.grad`` the way autograd's own does, through the parameter's
gradient accumulator (``torch.autograd.backward`` from the parameter itself), so post-accumulate-grad
hooks fire as usual: the data-parallel wrapper (``parallel.data_parallel.grads``) collects and reduces
them without knowing the schedule. A backward that runs outside a ``B`` op (no micro-batch is
current) computes ``dW`` at once, as a plain linear layer would.

Whether a backward defers is decided when it runs (a micro-batch is current), but a compiled block
traces its forward, and with it the linear's backward, during an ``F`` op, when none is: traced
into the graph, the decision was baked in, and every ``W`` op found nothing to do (GPT 1.3B, pp 2:
ZB-H1's W ops took 0.0 ms, BENCHMARKS.md). So every deferring linear is a custom operator, opaque
to the compiler: this module's plain one (``nn.Linear``, tensor-parallel linears without sequence
parallelism) and the sequence-parallel ones (``tensor_parallel.overlap``). Given the queue's number
(``parallel.weight_grad_takers``), their backward hands the queue ``(X, dY)`` when it runs. They
used to be kept out of the compiled graphs instead, which split each block into compiled pieces
whose host time set the pace under tensor parallelism: ZB-H2 at tp 2 x pp 2 ran 1.34x slower than
1F1B, its GPUs a third busy (BENCHMARKS.md). What a backward hands over must stay as it was until
``W``, and inductor plans buffer reuse as if no operator kept its inputs, so under a split-backward
schedule blocks and head compile with buffer reuse off (``models.parallelize.compile_options``).

Where the data-parallel wrapper keeps whole fp32 gradient buffers (ZeRO stages 0 and 1, and every
stage in a pipeline's once-per-step mode), a ``W`` op adds each weight's gradient GEMM straight into
its buffer instead (``WeightGradSink``, given at construction), and each bias's GEMV too: the GEMM
accumulates in fp32 and writes there, so the 16-bit gradient, autograd's accumulation and the hook's
conversion and add of every micro-batch disappear (GPT 1.3B, pp 2, ZB-H2: those adds took 25 ms of
the first stage's 1.08 s step; the step became 1% faster, BENCHMARKS.md). What the sink cannot add
as products (16-bit factors off CUDA) is summed over the micro-batches in fp32 and handed to it as
it is: through autograd the sum would be rounded to the parameter's 16 bits, where under fp16 a sum
of gradients that each fit overflows, and the step is skipped where 1F1B, which adds them one by one
into the fp32 buffer, trains.

``defer_weight_grads`` is the hook that turns the layers on: plain ``nn.Linear`` get an instance
``forward`` calling ``queue.linear``; the tensor-parallel linears get the queue as their
``weight_grads`` (``tensor_parallel.layers.Linears``).
"""

from __future__ import annotations

import contextlib
from typing import Hashable, Iterable, Iterator, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from parallel.tensor_parallel import overlap
from parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from parallel.weight_grad_takers import (IN_BACKWARD, deferral, hand_over, keep_params, register_weight_grad_taker,
                                         saved_params)


# A plain linear as a custom operator, forward and backward, for the reason the sequence-parallel ones
# are (``parallel.weight_grad_takers``): kept whole inside a compiled block, its backward still decides
# at run time where the weight gradient goes.

@torch.library.custom_op("megazero::deferrable_linear", mutates_args=())
def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], weight_grads_to: int) -> torch.Tensor:
    """``x W^T + b``."""
    return F.linear(x, weight, bias)


@_linear.register_fake
def _(x, weight, bias, weight_grads_to):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("megazero::deferrable_linear_backward", mutates_args=())
def _linear_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     weight_grads_to: int) -> torch.Tensor:
    """The input gradient ``dY W``; ``(X, dY)`` go to taker ``weight_grads_to`` for the weight's."""
    hand_over(weight_grads_to, weight, bias, x, grad_y)
    return grad_y @ weight


@_linear_backward.register_fake
def _(grad_y, x, weight, bias, weight_grads_to):
    return grad_y.new_empty((*grad_y.shape[:-1], weight.shape[1]))


def _linear_setup(ctx, inputs, output):
    x, weight, bias, weight_grads_to = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.weight_grads_to = weight_grads_to
    keep_params(ctx, weight, bias)


def _linear_grad(ctx, grad_y):
    x, weight, bias = ctx.saved_tensors
    weight, bias = saved_params(ctx, weight, bias)
    if deferral(ctx) == IN_BACKWARD:  # the input needs no gradient: every gradient here
        return (None, weight_grad([(x, grad_y)]) if ctx.needs_input_grad[1] else None,
                bias_grad([grad_y]) if bias is not None and ctx.needs_input_grad[2] else None, None)
    return _linear_backward(grad_y, x, weight, bias, ctx.weight_grads_to), None, None, None


_linear.register_autograd(_linear_grad, setup_context=_linear_setup)


def _summed(grads: list[torch.Tensor]) -> torch.Tensor:
    """One gradient from several micro-batches', summed in fp32 (and left there: rounding is for the
    place it goes to decide)."""
    if len(grads) == 1:
        return grads[0]
    return torch.stack([g.float() for g in grads]).sum(0)


def weight_grad_products(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The factors ``(dY^T, X)`` of each ``(X, dY)`` pair's weight gradient, leading dimensions flattened."""
    return [(g.reshape(-1, g.shape[-1]).t(), x.reshape(-1, x.shape[-1])) for x, g in pairs]


def weight_grad(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``sum dY^T X`` over ``(X, dY)`` pairs, every leading dimension flattened (in ``X``'s dtype for one
    pair, fp32 for several)."""
    return _summed([a @ b for a, b in weight_grad_products(pairs)])


def bias_grad(grad_outs: list[torch.Tensor]) -> torch.Tensor:
    """``sum dY`` over every token of every micro-batch."""
    return _summed([g.reshape(-1, g.shape[-1]).sum(0) for g in grad_outs])


class WeightGradSink(Protocol):
    """Where a linear's weight and bias gradients can be accumulated without autograd (``DataParallel``)."""

    def add_weight_grad(self, weight: torch.Tensor, products: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Add ``sum a @ b`` to ``weight``'s gradient (a weight's or a bias's) as if autograd had delivered
        it; False if declined."""

    def add_grad(self, param: torch.Tensor, grad: torch.Tensor) -> bool:
        """Add ``grad`` (fp32 when summed over micro-batches) to ``param``'s gradient as if autograd had
        delivered it, without rounding it to ``param``'s dtype first; False if declined."""


class WeightGradQueue:
    """The weight-gradient GEMMs of the micro-batches whose ``B`` ran and ``W`` has not.

    ``current`` names the micro-batch (any hashable key, the executor uses ``(micro-batch, chunk)``)
    whose backward is running; ``run(keys)`` computes and accumulates the queued gradients of ``keys``,
    into ``sink`` where it takes them, else through autograd.
    """

    def __init__(self, sink: Optional[WeightGradSink] = None):
        self.sink = sink
        self.current: Optional[Hashable] = None
        self.pending: dict[Hashable, list[tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor,
                                                 torch.Tensor]]] = {}
        # what the linears' backward operators call with the factors (``hand_over``)
        self.number = register_weight_grad_taker(self)
        self._ones: Optional[torch.Tensor] = None  # a row of ones as long as a micro-batch's tokens

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``F.linear`` with deferrable weight and bias gradients (traced into a compiled graph: the
        operator decides when its backward runs)."""
        return _linear(x, weight, bias, self.number)

    def column_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group,
                      mode: str) -> torch.Tensor:
        """``overlap.column_linear`` with deferrable weight and bias gradients (traced into a compiled
        graph: the operator decides when its backward runs)."""
        return overlap.column_linear(x, weight, bias, group, mode, weight_grads_to=self.number)

    def row_linear(self, x: torch.Tensor, weight: torch.Tensor, group, mode: str) -> torch.Tensor:
        """``overlap.row_linear`` with a deferrable weight gradient (as ``column_linear``)."""
        return overlap.row_linear(x, weight, group, mode, weight_grads_to=self.number)

    def hand_over(self, weight: torch.Tensor, bias: Optional[torch.Tensor], x: torch.Tensor,
                  grad_out: torch.Tensor) -> None:
        """The linears' backward operators: queue the weight gradient's factors inside a micro-batch's
        ``B``; outside one, compute and deliver the gradients at once."""
        if not isinstance(weight, nn.Parameter):  # the operator is handed the parameter itself
            raise TypeError(f"a deferred weight gradient came for a {type(weight).__name__}, not a parameter")
        bias = bias if bias is not None and bias.requires_grad else None
        if not weight.requires_grad and bias is None:  # frozen: nothing to compute
            return
        key = self.current if self.current is not None else object()
        self.pending.setdefault(key, []).append((weight, bias, x, grad_out))
        if self.current is None:
            self.run([key])

    @contextlib.contextmanager
    def backward_of(self, key: Hashable) -> Iterator[None]:
        """Queue the weight gradients of the backward run inside under ``key``."""
        self.current = key
        try:
            yield
        finally:
            self.current = None

    def run(self, keys: Iterable[Hashable]) -> tuple[int, int]:
        """Compute the queued weight gradients of ``keys`` and add them to ``.grad``, one sum per weight;
        returns how many GEMMs' worth of gradients were queued, and how many of them the sink took.

        Weights go in the order backward reached them, so the data-parallel buckets they fill (laid
        out in backward order) complete, and can start reducing, while later weights compute.
        """
        by_weight: dict[int, tuple[torch.Tensor, Optional[torch.Tensor], list]] = {}
        count = in_place = 0
        for key in keys:
            for weight, bias, x, grad_out in self.pending.pop(key, ()):
                by_weight.setdefault(id(weight), (weight, bias, []))[2].append((x, grad_out))
                count += 1
        for weight, bias, pairs in by_weight.values():
            summed = []
            if not weight.requires_grad:  # a frozen weight, queued for its trainable bias
                pass
            elif self.sink is not None and self.sink.add_weight_grad(weight, weight_grad_products(pairs)):
                in_place += len(pairs)
            else:
                summed.append((weight, weight_grad(pairs)))
            if bias is not None and not self._bias_grad_to_sink(bias, pairs):
                summed.append((bias, bias_grad([g for _, g in pairs])))
            self._deliver(summed)
        return count, in_place

    def _deliver(self, summed: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Each ``(parameter, gradient)`` to the sink where it takes it, unrounded; the others through
        autograd, in the parameter's dtype."""
        rest = [(p, g) for p, g in summed if self.sink is None or not self.sink.add_grad(p, g)]
        if rest:
            torch.autograd.backward([p for p, _ in rest], [g.to(p.dtype) for p, g in rest])

    def _bias_grad_to_sink(self, bias: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Hand the sink ``bias``'s gradient as the GEMVs ``1^T dY`` of ``pairs``, which it accumulates in
        fp32 like a weight's GEMMs; False where there is no sink or it declines. This replaces a 16-bit
        ``dY.sum(0)`` handed to autograd, its hook, and the conversion and add of every micro-batch's
        bias gradient: the GEMV ran 10-35% faster than ``sum(0)`` at GPT 1.3B's widths on an H200, and
        the sum stays in fp32 (the bias gradients were 23.5 ms of a 1.05 s pp 2 step on the busiest
        rank; the change took 7-8 ms off that step, BENCHMARKS.md)."""
        if self.sink is None:
            return False
        products = []
        for _, g in pairs:
            g = g.reshape(-1, g.shape[-1])
            ones = self._ones
            if ones is None or ones.shape[1] != g.shape[0] or ones.dtype != g.dtype or ones.device != g.device:
                ones = self._ones = torch.ones(1, g.shape[0], dtype=g.dtype, device=g.device)
            products.append((ones, g))
        return self.sink.add_weight_grad(bias, products)

    def __len__(self) -> int:
        """Micro-batches with weight gradients still queued."""
        return len(self.pending)


def defer_weight_grads(modules: Iterable[nn.Module], queue: WeightGradQueue) -> int:
    """Route every linear layer under ``modules`` through ``queue``; returns how many were found."""
    count = 0
    for module in modules:
        for layer in module.modules():
            if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
                layer.weight_grads = queue
            elif isinstance(layer, nn.Linear):
                layer.forward = lambda x, layer=layer: queue.linear(x, layer.weight, layer.bias)
            else:
                continue
            count += 1
    return count
