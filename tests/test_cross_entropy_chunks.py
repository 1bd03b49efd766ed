"""The fused cross-entropy's chunked projection and its autograd plumbing, on CPU.

``models.kernels.cross_entropy`` is plain torch around one Triton row kernel (``cross_entropy_rows``,
GPU-only, compared with torch in ``tests/test_kernels.py``). Here that kernel is replaced by the
same row math in torch, so what is left to check runs anywhere: the chunk loop, the two reductions
("sum": gradients computed in forward and scaled in backward; "none": the chunks again in
backward with any per-token weights), the vocabulary-parallel combine step, and evaluation under
``no_grad`` (a summed loss computes no gradient there).
"""

from __future__ import annotations

import pytest
import torch

from models import ops
from models.kernels import cross_entropy


def torch_rows(logits, labels, scale, loss, vocab_start, n_valid, combine, grad):
    """The row kernel's contract in torch: ``loss`` per row; with ``grad`` the logits become
    scale * (softmax - onehot) in place, 0 in the padding columns."""
    x = logits.float().clone()
    x[:, n_valid:] = float("-inf")
    local = labels - vocab_start
    mine = (local >= 0) & (local < n_valid)
    picked = torch.where(mine, x.gather(1, local.clamp(0, x.shape[1] - 1)[:, None])[:, 0], 0.0)
    peak = x.max(-1).values
    if combine is None:
        lse, label_logit = peak + (x - peak[:, None]).exp().sum(-1).log(), picked
    else:
        lse, label_logit = combine(peak, (x - peak[:, None]).exp().sum(-1), picked)
    loss.copy_(lse - label_logit)
    if grad:
        g = (x - lse[:, None]).exp()
        g[mine, local[mine]] -= 1.0
        logits.copy_(g * scale[:, None])


@pytest.fixture
def rows(monkeypatch):
    calls = []

    def counted(*args):
        calls.append(args[-1])  # whether this chunk computed a gradient
        return torch_rows(*args)
    monkeypatch.setattr(cross_entropy, "_row_kernel", lambda: counted)
    monkeypatch.setattr(cross_entropy, "CHUNK_ELEMENTS", 32 * 128)  # 32-row chunks: 4, the last partial
    return calls


def _inputs():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 50, 16, generator=g)
    w = torch.randn(128, 16, generator=g) * 0.3
    labels = torch.randint(0, 100, (2, 50), generator=g)
    labels[0, :3] = ops.IGNORE_INDEX
    return h, w, labels, 100


def _loss_and_grads(fn, h, w, weights):
    h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = fn(h, w)
    (loss / 3 if loss.dim() == 0 else (loss * weights).sum()).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_chunks_equal_the_reference_forward_and_backward(rows, reduction):
    h, w, labels, vocab = _inputs()
    weights = torch.rand(labels.shape, generator=torch.Generator().manual_seed(1))
    fused = _loss_and_grads(lambda h, w: cross_entropy.linear_cross_entropy(h, w, labels, vocab, reduction),
                            h, w, weights)
    reference = _loss_and_grads(lambda h, w: ops.linear_cross_entropy.reference(h, w, labels, vocab, reduction),
                                h, w, weights)
    for got, want in zip(fused, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # "sum" computes the gradient once, in forward; "none" runs the chunks again in backward
    assert rows == ([True] * 4 if reduction == "sum" else [False] * 4 + [True] * 4)


def test_combine_step_of_a_group_of_one(rows):
    """The vocabulary-parallel path (statistics, then the group's reduction) with one rank equals the
    one-pass path."""
    h, w, labels, vocab = _inputs()
    one_rank = lambda peak, sum_exp, picked: (peak + sum_exp.log(), picked)  # noqa: E731
    weights = torch.ones(labels.shape)
    grouped = _loss_and_grads(lambda h, w: cross_entropy.linear_cross_entropy(h, w, labels, vocab, "sum",
                                                                              combine=one_rank), h, w, weights)
    plain = _loss_and_grads(lambda h, w: cross_entropy.linear_cross_entropy(h, w, labels, vocab, "sum"),
                            h, w, weights)
    for got, want in zip(grouped, plain):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_summed_loss_under_no_grad_computes_no_gradient(rows):
    h, w, labels, vocab = _inputs()
    h.requires_grad_(True)
    with torch.no_grad():
        loss = cross_entropy.linear_cross_entropy(h, w, labels, vocab, "sum")
    torch.testing.assert_close(loss, ops.linear_cross_entropy.reference(h.detach(), w, labels, vocab, "sum"))
    assert rows == [False] * 4


def test_bf16_chunks_on_cpu_equal_the_fp32_reference(rows):
    """16-bit factors off CUDA take the other weight-gradient path (each chunk's product rounded to
    bf16, then written or added in fp32): it must equal fp32 math on the same values to bf16
    precision, the first chunk written over whatever the new buffer held."""
    h, w, labels, vocab = _inputs()
    h, w = h.bfloat16(), w.bfloat16()
    weights = torch.ones(labels.shape)
    fused = _loss_and_grads(lambda h, w: cross_entropy.linear_cross_entropy(h, w, labels, vocab, "sum"), h, w,
                            weights)
    reference = _loss_and_grads(lambda h, w: ops.linear_cross_entropy.reference(h.float(), w.float(), labels, vocab,
                                                                                "sum"), h, w, weights)
    assert fused[1].dtype == fused[2].dtype == torch.bfloat16
    for got, want in zip(fused, reference):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_first_chunk_overwrites_whatever_the_weight_gradient_held(dtype):
    """Both weight-gradient paths (one GEMM into fp32; a 16-bit product then copied or added) write
    the first chunk over the buffer's old contents, here NaN, and add the later ones."""
    g = torch.Generator().manual_seed(2)
    a, b, c = (torch.randn(6, 5, generator=g).to(dtype) for _ in range(3))
    grad = torch.full((5, 5), float("nan"))
    cross_entropy._accumulate(grad, a, b, first=True)
    cross_entropy._accumulate(grad, a, c, first=False)
    want = (a.t() @ b).float() + (a.t() @ c).float()
    torch.testing.assert_close(grad, want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-2)


def test_no_tokens_give_zero_gradients(rows):
    h, w = torch.zeros(0, 16, requires_grad=True), torch.randn(128, 16, requires_grad=True)
    loss = cross_entropy.linear_cross_entropy(h, w, torch.zeros(0, dtype=torch.long), 100, "sum")
    loss.backward()
    assert loss.item() == 0 and h.grad.shape == (0, 16) and torch.equal(w.grad, torch.zeros_like(w))
