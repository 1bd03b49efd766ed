"""Cross-entropy fused with the vocabulary projection: the logits exist one chunk of rows at a time.

The plain head writes logits [tokens, vocab] and the loss reads them back in fp32: at micro-batch 8,
sequence 2048 and GPT-2's vocabulary that is 1.6 GB of bf16 logits, 3.3 GB of fp32 copies and as
much again for their gradient. Here the forward pass walks the tokens in chunks; for each chunk

    logits = x_c W^T                          (one bf16 GEMM into a reused buffer)
    loss, dlogits = row kernel(logits)        (Triton, ``cross_entropy_rows``: one read, the gradient
                                              written in place)
    dx_c = dlogits W ;  dW += dlogits^T x_c   (two GEMMs, dW accumulated in fp32)

The caller names the reduction. With ``"sum"`` (what training asks for: the engine sums the
per-token loss, then divides by the count of real labels) every token's loss gets the same
gradient, so the forward pass computes dx and dW of the sum as it goes, and the backward pass only
scales them by the incoming scalar, on the device, with no host sync. With ``"none"`` the per-token
loss may be weighted in any way, so the forward pass computes the loss alone and the backward pass
runs the chunks again with the incoming gradient folded into dlogits: exact for any weights.

Vocabulary-parallel form: ``weight`` is this rank's slice of the (padded) vocabulary starting at
``vocab_start``, and ``combine`` reduces each chunk's per-row (max, sum of exp, label logit) over
the tensor-parallel group (see ``parallel/tensor_parallel/cross_entropy.py``); the row kernel then
runs in two passes around that reduction. Columns at or past ``vocab_size`` (the padding) get no
probability and no gradient.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from parallel.matmul import can_matmul_into, matmul_into

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 2**29
"""Logits per chunk (rows x local vocabulary): 1 GiB in bf16. Each chunk adds its weight gradient
into the fp32 one (a read and write of the whole [vocab, hidden] matrix), so fewer chunks cost less:
at 125M (32,768 tokens) four chunks of 8,192 rows instead of eight."""

Combine = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(row max, row sum of exp(logit - max), label logit) of this rank -> (logsumexp, label logit) of all."""


def _row_kernel() -> Callable:
    """``loss_and_grad(logits, labels, scale, loss, vocab_start, n_valid, combine, grad)``: fills
    ``loss`` for a chunk and, with ``grad``, turns ``logits`` into the loss's gradient in place. The
    Triton body is imported on first use, so this module imports without Triton."""
    from models.kernels.cross_entropy_rows import loss_and_grad
    return loss_and_grad


def _chunk_rows(local_vocab: int, tokens: int) -> int:
    rows = 1 << max(0, (CHUNK_ELEMENTS // max(local_vocab, 1)).bit_length() - 1)
    return max(1, min(rows, tokens))


def _accumulate(grad_weight: torch.Tensor, dlogits: torch.Tensor, x: torch.Tensor, first: bool) -> None:
    """grad_weight (fp32) = (first chunk) or += dlogits^T x, in one GEMM that reads bf16/fp16 operands
    and writes fp32 where the device can (else the product rounded to the operands' dtype)."""
    if can_matmul_into(grad_weight.dtype, dlogits, x):
        matmul_into(grad_weight, dlogits.t(), x, accumulate=not first)
    elif first:
        grad_weight.copy_(dlogits.t() @ x)
    else:
        grad_weight += (dlogits.t() @ x).float()


def _run_chunks(hidden, weight, labels, scale, vocab_start: int, n_valid: int, combine: Optional[Combine],
                grad: bool):
    """Loss per row and, with ``grad``, dx and fp32 dW of sum(scale * loss)."""
    tokens, local_vocab = hidden.shape[0], weight.shape[0]
    rows = _chunk_rows(local_vocab, tokens)
    buffer = hidden.new_empty(rows, local_vocab)
    loss = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if grad else None
    # written by the first chunk, so only zero tokens (no chunk at all) need it cleared
    new = torch.empty if tokens else torch.zeros
    grad_weight = new(weight.shape, dtype=torch.float32, device=weight.device) if grad else None
    row_kernel = _row_kernel()
    for start in range(0, tokens, rows):
        end = min(start + rows, tokens)
        x, logits = hidden[start:end], buffer[:end - start]
        torch.mm(x, weight.t(), out=logits)
        row_kernel(logits, labels[start:end], scale[start:end], loss[start:end], vocab_start, n_valid,
                   combine, grad)
        if grad:
            torch.mm(logits, weight, out=grad_hidden[start:end])
            _accumulate(grad_weight, logits, x, first=start == 0)
    return loss, grad_hidden, grad_weight


class LinearCrossEntropy(torch.autograd.Function):
    """Loss of ``hidden [tokens, h] @ weight[v, h]^T`` against ``labels [tokens]``: per token, or
    (``reduction="sum"``) summed, with the gradient of the sum computed in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab_size: int, reduction: str, vocab_start: int,
                combine: Optional[Combine], wants_grad: bool):
        valid = labels != IGNORE_INDEX
        n_valid = max(0, min(weight.shape[0], vocab_size - vocab_start))
        ctx.summed = reduction == "sum"
        grad = ctx.summed and wants_grad and any(ctx.needs_input_grad[:2])
        loss, grad_hidden, grad_weight = _run_chunks(hidden, weight, labels, valid.float(), vocab_start, n_valid,
                                                     combine, grad)
        loss.masked_fill_(~valid, 0.0)
        if ctx.summed:
            ctx.save_for_backward(grad_hidden, grad_weight)
            ctx.weight_dtype = weight.dtype
            return loss.sum()
        ctx.chunk_args = (vocab_start, n_valid, combine)
        ctx.save_for_backward(hidden, weight, labels)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.summed:  # one scalar for every token: scale what forward computed
            grad_hidden, grad_weight = ctx.saved_tensors
            # a one-element (not 0-dim) factor promotes to fp32, so the scale is not rounded to 16 bits
            # before the multiply (a CUDA 0-dim tensor would be); the product is rounded as it is
            # written, in one pass
            scale = grad_loss.reshape(1)
            return (torch.mul(grad_hidden, scale, out=torch.empty_like(grad_hidden)),
                    torch.mul(grad_weight, scale, out=torch.empty_like(grad_weight, dtype=ctx.weight_dtype)),
                    None, None, None, None, None, None)
        hidden, weight, labels = ctx.saved_tensors  # weights that may differ: fold them into dlogits
        scale = torch.where(labels != IGNORE_INDEX, grad_loss, 0.0).float()
        _, grad_hidden, grad_weight = _run_chunks(hidden, weight, labels, scale, *ctx.chunk_args, grad=True)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                         reduction: str = "none", vocab_start: int = 0,
                         combine: Optional[Combine] = None) -> torch.Tensor:
    """Loss (fp32) of ``hidden [..., h]`` projected by ``weight [local_vocab, h]``, whose row ``i`` is the
    vocabulary entry ``vocab_start + i``: per token with ``reduction="none"`` (shaped like ``labels``, 0
    where ignored), or its sum over tokens with ``"sum"`` (a scalar)."""
    if reduction not in ("none", "sum"):
        raise ValueError(f"reduction must be 'none' or 'sum', not {reduction!r}")
    # forward runs with autograd off, and needs_input_grad stays True under no_grad (evaluation):
    # whether a gradient is wanted is read here
    loss = LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1).contiguous(),
                                    vocab_size, reduction, vocab_start, combine, torch.is_grad_enabled())
    return loss if reduction == "sum" else loss.view(labels.shape)
