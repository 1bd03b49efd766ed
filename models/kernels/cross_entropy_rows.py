"""The Triton row kernel of the fused cross-entropy: per row of a logits chunk, the loss and (in
place) its gradient, in one pass or in two around a tensor-parallel reduction.

Kept apart from the chunked projection (``cross_entropy``), which is plain torch, so that only this
module needs Triton and the rest can be checked on any machine against a torch row function.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import triton
import triton.language as tl

ROW_BLOCK, ROW_WARPS = 2048, 4
"""Columns a program holds at once (a row of the vocabulary is walked in such blocks), and warps a
program: the fastest of a sweep on an H200 (``benchmarks/kernels_gpu.py --only cross_entropy_tiles``),
3.6 TB/s against 3.2 at 4096 columns and 16 warps. Small programs keep more rows in flight."""
WHOLE, STATS, GRAD_FROM_LSE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
"""Row-kernel passes: loss (and gradient) on one rank; the statistics a group reduces; the gradient
from the group's logsumexp."""


@triton.jit
def _row_stats(row_ptr, n_valid, label, BLOCK: tl.constexpr):
    """Online max and sum of exp over the valid columns of one row, and the label's logit (0 when
    the label lies outside this row's columns)."""
    m = float("-inf")
    s = 0.0
    for off in range(0, n_valid, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < n_valid, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    mine = (label >= 0) & (label < n_valid)
    picked = tl.load(row_ptr + tl.where(mine, label, 0), mask=mine, other=0.0).to(tl.float32)
    return m, s, picked


@triton.jit
def _cross_entropy_rows(x_ptr, stride, labels_ptr, scale_ptr, out0, out1, out2, vocab_start, n_valid, n_cols,
                        PASS: tl.constexpr, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row of a logits chunk.

    PASS WHOLE: out0 = logsumexp - label logit; with GRAD the row is then overwritten with
    scale * (softmax - onehot). PASS STATS: out0, out1, out2 = max, sum of exp, label logit.
    PASS GRAD_FROM_LSE: the gradient as in WHOLE, from the logsumexp in out0. Padding columns
    (n_valid <= column < n_cols) get gradient 0.
    """
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * stride
    label = tl.load(labels_ptr + row) - vocab_start
    if PASS == GRAD_FROM_LSE:
        lse = tl.load(out0 + row)
    else:
        m, s, picked = _row_stats(row_ptr, n_valid, label, BLOCK)
        lse = m + tl.log(s)
        if PASS == WHOLE:
            tl.store(out0 + row, lse - picked)
        else:
            tl.store(out0 + row, m)
            tl.store(out1 + row, s)
            tl.store(out2 + row, picked)
    if GRAD:
        scale = tl.load(scale_ptr + row)
        for off in range(0, n_cols, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            g = tl.where(cols == label, p - 1.0, p) * scale
            g = tl.where(cols < n_valid, g, 0.0)
            tl.store(row_ptr + cols, g.to(x_ptr.dtype.element_ty), mask=cols < n_cols)


def _rows(logits, labels, scale, outs, vocab_start: int, n_valid: int, which: tl.constexpr, grad: bool) -> None:
    n = logits.shape[0]
    _cross_entropy_rows[(n,)](logits, logits.stride(0), labels, scale, *outs, vocab_start, n_valid,
                              logits.shape[1], PASS=which.value, GRAD=grad, BLOCK=ROW_BLOCK,
                              num_warps=ROW_WARPS)


def loss_and_grad(logits, labels, scale, loss, vocab_start: int, n_valid: int, combine: Optional[Callable],
                  grad: bool) -> None:
    """Fill ``loss`` for one chunk; with ``grad`` turn ``logits`` into the loss's gradient in place."""
    if combine is None:
        _rows(logits, labels, scale, (loss, loss, loss), vocab_start, n_valid, WHOLE, grad)
        return
    peak, sum_exp, picked = torch.empty(3, logits.shape[0], dtype=torch.float32, device=logits.device)
    _rows(logits, labels, scale, (peak, sum_exp, picked), vocab_start, n_valid, STATS, False)
    lse, label_logit = combine(peak, sum_exp, picked)
    torch.sub(lse, label_logit, out=loss)
    if grad:
        _rows(logits, labels, scale, (lse, lse, lse), vocab_start, n_valid, GRAD_FROM_LSE, True)
