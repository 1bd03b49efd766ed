"""The weight-gradient queue of the split-backward schedules (``parallel.pipeline.deferred_wgrad``),
one process, eager: what it queues, computes and delivers, against a plain ``nn.Linear``. The
engine-level checks (every schedule against one process) are in ``tests/test_pipeline_zero_bubble.py``."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint

from parallel.pipeline.deferred_wgrad import WeightGradQueue, defer_weight_grads
from tests.sharded import sharded_adamw


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


def _backward_two(layer, ref, queue, forward=None):
    """Two micro-batches' backwards through ``layer`` (``forward``: how it is called), each queued under
    its number, and through the plain ``ref`` (when given) for the reference gradients."""
    for k, x in enumerate(_inputs(2)):
        with queue.backward_of(k):
            (forward or layer)(x).square().sum().backward()
        if ref is not None:
            ref(x.detach()).square().sum().backward()


def _inputs(count):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, 6, generator=g, requires_grad=True) for _ in range(count)]


def test_a_frozen_half_of_a_deferred_linear_gets_no_gradient():
    """A frozen bias hands nothing to W and the weight still gets autograd's gradient there; a frozen
    weight queues nothing at all and W raises nothing. (Planted: the frozen checks removed; W then
    handed autograd a gradient for a tensor that needs none, and raised.)"""
    layer, ref, queue = _linear_on_a_queue(frozen=("bias",))
    _backward_two(layer, ref, queue)
    assert queue.run([0, 1]) == (2, 0) and len(queue) == 0
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-6)
    assert layer.bias.grad is None

    layer, _, queue = _linear_on_a_queue(frozen=("weight", "bias"))
    _backward_two(layer, None, queue)
    assert queue.run([0, 1]) == (0, 0) and len(queue) == 0
    assert layer.weight.grad is None and layer.bias.grad is None


def test_a_trainable_bias_behind_a_frozen_weight_gets_its_gradient():
    """Bias-only fine-tuning: with the weight frozen, the bias of a deferring linear never received a
    gradient, in or out of a B op (its operator returns none, and ``hand_over`` returned for the
    frozen weight before it queued the bias). The input's gradient, which the layers before wait for,
    is still the plain layer's. (Planted: deferral decided by whether the weight needs a gradient, not
    the input; a frozen weight then sent no input gradient at all. And the bias's gradient computed in
    backward only where the weight needs one.)"""
    layer, ref, queue = _linear_on_a_queue(frozen=("weight",))
    x = _inputs(1)[0]
    x_ref = x.detach().requires_grad_()
    with queue.backward_of(0):
        layer(x).square().sum().backward()
    ref(x_ref).square().sum().backward()
    queue.run([0])
    assert layer.bias.grad is not None
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    layer.bias.grad = ref.bias.grad = None
    x = x.detach()  # an input needing no gradient: the operator computes the bias's in its own backward
    layer(x).square().sum().backward()
    ref(x).square().sum().backward()
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=1e-6, atol=1e-6)


def test_a_backward_after_a_b_op_delivers_at_once():
    """Leaving ``backward_of`` ends the micro-batch: a later backward outside a B op computes its weight
    gradient at once, nothing left queued, also after a B op that raised. (Planted: ``current`` not
    reset on exit, or not on an exception, so the later backward was queued under the finished
    micro-batch's key.)"""
    layer, ref, queue = _linear_on_a_queue()
    first, second = _inputs(2)
    with pytest.raises(RuntimeError, match="timed out"):  # a B op that raised ends its micro-batch too
        with queue.backward_of(1):
            raise RuntimeError("timed out")
    assert queue.current is None
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

    def add_grad(self, param, grad):
        return False  # gradients already computed go through autograd


def test_a_sink_takes_the_weight_and_the_bias():
    """Where the sink takes a linear's gradients, ``run`` counts every micro-batch's weight GEMM it took
    (two micro-batches summed at one W: 2, not one per weight), and the bias's comes as GEMV factors
    ``(1^T, dY)`` whose sum is autograd's bias gradient; nothing reaches ``.grad``. (Planted:
    ``in_place`` counting weights; the bias handed to autograd beside the sink.)"""
    sink = _TakeEverything()
    layer, ref, queue = _linear_on_a_queue(sink)
    _backward_two(layer, ref, queue)
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
    _backward_two(layer, ref, queue)
    assert queue.run([0, 1]) == (2, 2)
    assert layer.weight.grad is None and id(layer.bias) not in sink.sums
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=1e-6, atol=1e-6)


def test_a_recomputed_linear_hands_over_its_parameters():
    """Full recompute: a checkpointed block's forward runs again inside its backward, and the tensors
    its operators saved come back as detached copies, no longer the parameters that ``hand_over`` and
    ``W`` deliver to. (Found: every linear raised TypeError under a split-backward schedule without
    torch.compile, the CPU default.)"""
    layer, ref, queue = _linear_on_a_queue()
    _backward_two(layer, ref, queue, lambda x: torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False))
    assert queue.run([0, 1]) == (2, 0)
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=1e-6, atol=1e-6)


class _TakeMatchingFactors(_TakeEverything):
    """A sink that, as the data-parallel buffers' GEMM does, needs factors of one dtype whose inner
    dimensions match; it records each bias's ``1^T`` factor."""

    def __init__(self):
        super().__init__()
        self.ones = []

    def add_weight_grad(self, weight, products):
        for a, b in products:
            assert a.dtype == b.dtype and a.shape[1] == b.shape[0], (a.dtype, b.dtype, a.shape, b.shape)
        if weight.dim() == 1:
            self.ones += [a for a, _ in products]
        return super().add_weight_grad(weight, products)


def test_a_bias_gemv_row_of_ones_follows_each_micro_batch():
    """The row of ones a bias's GEMV ``1^T dY`` is built from is kept between W ops, and must be made
    again when a micro-batch has another number of tokens or another dtype: micro-batches of 3, 5
    and 3 tokens, then a float64 one, each give the sink matching factors and autograd's bias
    gradient. (Planted: the cached row reused whatever its length, or whatever its dtype.)"""
    sink = _TakeMatchingFactors()
    layer, ref, queue = _linear_on_a_queue(sink)
    g = torch.Generator().manual_seed(2)
    for k, tokens in enumerate((3, 5, 3)):
        x = torch.randn(tokens, 6, generator=g, requires_grad=True)
        with queue.backward_of(k):
            layer(x).square().sum().backward()
        ref(x.detach()).square().sum().backward()
        assert queue.run([k]) == (1, 1)
    torch.testing.assert_close(sink.sums[id(layer.bias)].view(-1), ref.bias.grad, rtol=1e-6, atol=1e-6)
    assert [a.shape[1] for a in sink.ones] == [3, 5, 3]

    layer.double()
    sink.sums.clear()
    x = torch.randn(3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    with queue.backward_of(3):
        layer(x).sum().backward()
    assert queue.run([3]) == (1, 1)
    assert sink.ones[-1].dtype == torch.float64
    torch.testing.assert_close(sink.sums[id(layer.bias)].view(-1), torch.full((4,), 3.0), check_dtype=False)


def test_micro_batches_summed_at_one_w_round_to_16_bits_once():
    """Without a sink, W sums a bf16 weight's and bias's gradients over its micro-batches in fp32 and
    rounds that sum to bf16 once: the result is the fp32 sum of the micro-batches' products, rounded
    once. (Planted: the micro-batches' 16-bit gradients added one after another in bf16, rounding at
    every add.)"""
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8).to(torch.bfloat16)
    queue = WeightGradQueue()
    defer_weight_grads([layer], queue)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(64, 16, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(8)]
    dys = [torch.randn(64, 8, generator=g).to(torch.bfloat16) for _ in range(8)]
    for k, (x, dy) in enumerate(zip(xs, dys)):
        with queue.backward_of(k):
            layer(x).backward(dy)
    assert queue.run(range(8)) == (8, 0)
    weight = torch.stack([(dy.t() @ x.detach()).float() for x, dy in zip(xs, dys)]).sum(0).to(torch.bfloat16)
    bias = torch.stack([dy.sum(0).float() for dy in dys]).sum(0).to(torch.bfloat16)
    assert layer.weight.grad.dtype == torch.bfloat16
    assert torch.equal(layer.weight.grad, weight)
    assert torch.equal(layer.bias.grad, bias)


def _fp16_linear_on_a_queue(group):
    """An fp16 ``nn.Linear(2, 2)`` under ZeRO 1 with fp32 gradient buffers, deferring to a queue whose
    sink is the data-parallel wrapper: off CUDA it takes each W op's sums through ``add_grad``."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(2, 2)
    optimizer = sharded_adamw(layer, group, stage=1, param_dtype=torch.float16, clip_grad=0.0)
    queue = WeightGradQueue(optimizer.dp)
    defer_weight_grads([layer], queue)
    return layer, optimizer, queue


def _backward_of_40000(layer, queue, k):
    """Micro-batch ``k``'s backward, queued under ``k``: each of the layer's six gradient elements is 40000."""
    with queue.backward_of(k):  # the input needs a gradient, or the layer would not defer
        out = layer(torch.ones(1, 2, dtype=torch.float16, requires_grad=True))
        out.backward(torch.full_like(out, 40000.0))


@pytest.mark.parametrize("w_ops", [[[0, 1]], [[0], [1]]], ids=["one W", "a W each"])
def test_a_sum_over_micro_batches_reaches_fp32_buffers_unrounded(one_rank_group, w_ops):
    """fp16 weights, fp32 gradient buffers: two micro-batches' gradients of 40000 each fit in fp16, and
    1F1B adds them into the fp32 buffer one at a time. A W op sums them first; that sum (80000) must
    reach the buffer in fp32, not be rounded to fp16 on the way (inf: the step was skipped as an
    overflow that no other schedule had). It is the path of whatever the sink cannot add as 16-bit
    products in place: off CUDA, both the weight and the bias. (Planted: the sum handed to autograd.)
    With a W op per micro-batch, back to back as a schedule's cool-down runs them, the first W's
    gradient is still a queued copy when the second's arrives: it must land before the second is
    added to it, or the copy lands over the sum and one micro-batch's gradient is lost."""
    layer, optimizer, queue = _fp16_linear_on_a_queue(one_rank_group)
    for k in range(2):
        _backward_of_40000(layer, queue, k)
    for keys in w_ops:
        queue.run(keys)
    result = optimizer.step()
    assert not result.skipped
    assert result.grad_norm == pytest.approx(80000.0 * 6**0.5)  # six gradient elements of 80000


def test_a_split_backward_step_refuses_weight_gradients_it_did_not_run(one_rank_group, monkeypatch):
    """A one-stage executor under zb-h1: a step whose plan lacks the W ops would leave every linear's
    weight gradient queued and ``.grad`` unset, and linears that queue nothing at their W (all frozen
    here; or compiled so that backward computed them) mean the split is not happening: each raises,
    naming what went wrong, instead of returning a loss. (Planted: either check removed.)"""
    import parallel.pipeline.executor as executor_module
    from parallel.pipeline import PipelineExecutor
    from parallel.pipeline.plan import comm_plan
    from parallel.topology import RankGrid, Topology

    topo = Topology(RankGrid(tp=1, pp=1, dp=1))
    data = [(x, None) for x in _inputs(2)]

    def executor(frozen=False):
        layer = torch.nn.Linear(6, 4).requires_grad_(not frozen)
        return PipelineExecutor([layer], topo, (3, 4), schedule="zb-h1",
                                forward_step=lambda module, x, mb, first, last: module(mb[0]).square().mean())

    planned = executor_module.plan_for

    def without_w(*args):
        ops = [op for op in planned(*args)[0] if op.kind != "W"]
        return ops, comm_plan(ops, 1, 0)

    with monkeypatch.context() as patched:
        patched.setattr(executor_module, "plan_for", without_w)
        with pytest.raises(RuntimeError, match=r"weight gradients of \[\(0, 0\), \(1, 0\)\] .*never ran"):
            executor().step(data)
    with pytest.raises(RuntimeError, match="W0 found no weight gradients queued by its B"):
        executor(frozen=True).step(data)
    executor().step(data)  # and the schedule as planned runs


def test_a_step_dropped_after_its_w_ops_leaves_no_gradient_behind(one_rank_group):
    """A rehearsal of the first step runs its W ops and then drops the step (``zero_grad``), releasing
    the gradient buffers: W gradients still queued as copies must be dropped with it, not landed by
    the next step's first gradient into buffers that hold no memory (it raised) or over its values.
    (Planted: ``zero`` keeping the queued copies.)"""
    layer, optimizer, queue = _fp16_linear_on_a_queue(one_rank_group)
    _backward_of_40000(layer, queue, 0)
    queue.run([0])
    optimizer.zero_grad()
    _backward_of_40000(layer, queue, 1)
    queue.run([1])
    assert optimizer.step().grad_norm == pytest.approx(40000.0 * 6**0.5)
