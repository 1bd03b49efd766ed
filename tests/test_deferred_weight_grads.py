"""The weight-gradient queue of the split-backward schedules (``parallel.pipeline.deferred_wgrad``),
one process, eager: what it queues, computes and delivers, against a plain ``nn.Linear``. The
engine-level checks (every schedule against one process) are in ``tests/test_pipeline_zero_bubble.py``."""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from parallel.pipeline.deferred_wgrad import WeightGradQueue, defer_weight_grads


def _linear_on_a_queue(sink=None, frozen=()):
    """An ``nn.Linear(6, 4)`` routed through a fresh ``WeightGradQueue`` (``frozen``: names of its
    parameters that need no gradient), and a same-valued plain copy for reference."""
    torch.manual_seed(0)
    layer, ref = torch.nn.Linear(6, 4), torch.nn.Linear(6, 4)
    ref.load_state_dict(layer.state_dict())
    for name in frozen:
        getattr(layer, name).requires_grad_(False)
        getattr(ref, name).requires_grad_(False)
    queue = WeightGradQueue(sink)
    assert defer_weight_grads([layer], queue) == 1
    return layer, ref, queue


def _inputs(count):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, 6, generator=g, requires_grad=True) for _ in range(count)]


def test_a_frozen_half_of_a_deferred_linear_gets_no_gradient():
    """A frozen bias hands nothing to W and the weight still gets autograd's gradient there; a frozen
    weight queues nothing at all and W raises nothing. (Planted: the frozen checks removed; W then
    handed autograd a gradient for a tensor that needs none, and raised.)"""
    layer, ref, queue = _linear_on_a_queue(frozen=("bias",))
    for k, x in enumerate(_inputs(2)):
        with queue.backward_of(k):
            layer(x).square().sum().backward()
        ref(x.detach()).square().sum().backward()
    assert queue.run([0, 1]) == (2, 0) and len(queue) == 0
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-6)
    assert layer.bias.grad is None

    layer, _, queue = _linear_on_a_queue(frozen=("weight", "bias"))
    for k, x in enumerate(_inputs(2)):
        with queue.backward_of(k):
            layer(x).square().sum().backward()
    assert queue.run([0, 1]) == (0, 0) and len(queue) == 0
    assert layer.weight.grad is None and layer.bias.grad is None


def test_a_trainable_bias_behind_a_frozen_weight_gets_its_gradient():
    """Bias-only fine-tuning: with the weight frozen, the bias of a deferring linear never received a
    gradient, in or out of a B op (its operator returns none, and ``hand_over`` returned for the
    frozen weight before it queued the bias)."""
    layer, ref, queue = _linear_on_a_queue(frozen=("weight",))
    x = _inputs(1)[0]
    with queue.backward_of(0):
        layer(x).square().sum().backward()
    ref(x.detach()).square().sum().backward()
    queue.run([0])
    assert layer.bias.grad is not None
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=1e-6, atol=1e-6)


def test_a_backward_after_a_b_op_delivers_at_once():
    """Leaving ``backward_of`` ends the micro-batch: a later backward outside a B op computes its weight
    gradient at once, nothing left queued. (Planted: ``current`` not reset on exit, so the later
    backward was queued under the finished micro-batch's key.)"""
    layer, ref, queue = _linear_on_a_queue()
    first, second = _inputs(2)
    with queue.backward_of(0):
        layer(first).sum().backward()
    assert queue.current is None
    queue.run([0])
    layer.weight.grad = layer.bias.grad = None
    layer(second).square().sum().backward()  # no micro-batch current
    ref(second.detach()).square().sum().backward()
    assert len(queue) == 0
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=1e-6, atol=1e-6)


class _TakeEverything:
    """A ``WeightGradSink`` that adds every product into its own fp32 buffer per weight."""

    def __init__(self):
        self.sums = {}

    def add_weight_grad(self, weight, products):
        total = sum(a.float() @ b.float() for a, b in products)
        self.sums[id(weight)] = self.sums.get(id(weight), 0) + total
        return True


def test_a_sink_takes_the_weight_and_the_bias():
    """Where the sink takes a linear's gradients, ``run`` counts every micro-batch's weight GEMM it took
    (two micro-batches summed at one W: 2, not one per weight), and the bias's comes as GEMV factors
    ``(1^T, dY)`` whose sum is autograd's bias gradient; nothing reaches ``.grad``. (Planted:
    ``in_place`` counting weights; the bias handed to autograd beside the sink.)"""
    sink = _TakeEverything()
    layer, ref, queue = _linear_on_a_queue(sink)
    for k, x in enumerate(_inputs(2)):
        with queue.backward_of(k):
            layer(x).square().sum().backward()
        ref(x.detach()).square().sum().backward()
    assert queue.run([0, 1]) == (2, 2)
    assert layer.weight.grad is None and layer.bias.grad is None
    torch.testing.assert_close(sink.sums[id(layer.weight)], ref.weight.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sink.sums[id(layer.bias)].view(-1), ref.bias.grad, rtol=1e-6, atol=1e-6)


class _TakeWeights(_TakeEverything):
    """A sink that declines 1-D parameters (a bias), as one whose buffer cannot take them would."""

    def add_weight_grad(self, weight, products):
        return weight.dim() > 1 and super().add_weight_grad(weight, products)


def test_a_bias_the_sink_declines_reaches_grad():
    """The weight goes to the sink and the declined bias gets its summed gradient through autograd.
    (Planted: a declined bias dropped.)"""
    sink = _TakeWeights()
    layer, ref, queue = _linear_on_a_queue(sink)
    for k, x in enumerate(_inputs(2)):
        with queue.backward_of(k):
            layer(x).square().sum().backward()
        ref(x.detach()).square().sum().backward()
    assert queue.run([0, 1]) == (2, 2)
    assert layer.weight.grad is None and id(layer.bias) not in sink.sums
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=1e-6, atol=1e-6)


def test_a_recomputed_linear_hands_over_its_parameters():
    """Full recompute: a checkpointed block's forward runs again inside its backward, and the tensors
    its operators saved come back as detached copies, no longer the parameters that ``hand_over`` and
    ``W`` deliver to. (Found: every linear raised TypeError under a split-backward schedule without
    torch.compile, the CPU default.)"""
    layer, ref, queue = _linear_on_a_queue()
    for k, x in enumerate(_inputs(2)):
        with queue.backward_of(k):
            torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False).square().sum().backward()
        ref(x.detach()).square().sum().backward()
    assert queue.run([0, 1]) == (2, 0)
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=1e-6, atol=1e-6)
