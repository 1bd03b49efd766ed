"""Cross-entropy over vocabulary-split logits, without ever gathering the full logits.

Each rank holds logits for its vocabulary slice ``[start, start + V/tp)``. The loss
``log(sum_j exp(z_j)) - z_label`` needs three reductions over the vocabulary: the max (for
stability; no gradient flows through it), the sum of exponentials and the label's logit (held by
exactly one rank). Both sums go through ``reduce_from_tp`` (all-reduce forward, identity
backward), so autograd gives each rank the gradient of its own slice: softmax minus one-hot.
Columns at or past ``vocab_size`` (the padding) are set to -inf: they add nothing to the sum and
receive no gradient.

The module form takes the final hidden state and the (column-parallel) head instead of logits.
Where the model's loss offers a fused kernel for the device (``kernel_for``: on GPU, the chunked
projection of ``models.kernels``), the logits of this rank's slice exist one chunk of tokens at a
time and each chunk's per-row max, sum of exponentials and label logit are reduced here
(``_combine``: two all-reduces of one float per token); elsewhere the head runs and the function
above reduces its logits.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from parallel import comm
from parallel.tensor_parallel.collectives import copy_to_tp, gather_sequence, reduce_from_tp


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, group,
                                 reduction: str = "none", ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss (fp32, shaped like ``labels``; 0 where ``labels == ignore_index``), or with
    ``reduction="sum"`` its sum over tokens (an fp32 scalar, the same on every rank of ``group``)."""
    if reduction not in ("none", "sum"):
        raise ValueError(f"reduction must be 'none' or 'sum', not {reduction!r}")
    local_vocab = logits.shape[-1]
    start = dist.get_rank(group) * local_vocab
    logits = logits.float()
    if start + local_vocab > vocab_size:
        padding = torch.arange(start, start + local_vocab, device=logits.device) >= vocab_size
        logits = logits.masked_fill(padding, float("-inf"))
    peak = logits.detach().max(dim=-1, keepdim=True).values
    comm.all_reduce(peak, group, op=dist.ReduceOp.MAX)
    shifted = logits - peak
    sum_exp = reduce_from_tp(shifted.exp().sum(dim=-1), group)
    ignored = labels == ignore_index
    local_label = labels - start
    mine = (local_label >= 0) & (local_label < local_vocab) & ~ignored
    picked = shifted.gather(-1, local_label.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    label_logit = reduce_from_tp(picked.masked_fill(~mine, 0.0), group)
    loss = (sum_exp.log() - label_logit).masked_fill(ignored, 0.0)
    return loss.sum() if reduction == "sum" else loss


def _combine(group):
    """Per-row (max, sum of exp(logit - max), label logit) of each rank -> (logsumexp, label logit)
    of the whole vocabulary; the label logit is 0 on every rank but the one holding the label."""
    def combine(peak: torch.Tensor, sum_exp: torch.Tensor, picked: torch.Tensor):
        top = peak.clone()
        comm.all_reduce(top, group, op=dist.ReduceOp.MAX)
        sums = torch.stack((sum_exp * torch.exp(peak - top), picked))
        comm.all_reduce(sums, group)
        return top + sums[0].log(), sums[1]
    return combine


class VocabParallelCrossEntropy(nn.Module):
    """Drop-in for the model's loss module: (hidden, head, labels, reduction) -> the per-token loss
    (``"none"``) or its sum over tokens (``"sum"``) over a padded vocabulary split across the tensor
    group, the head being column-parallel."""

    def __init__(self, vocab_size: int, group, kernel_for: Optional[Callable] = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.group = group
        self.kernel_for = kernel_for

    @classmethod
    def from_loss(cls, loss: nn.Module, group, sequence_parallel: bool = False, memo=None):
        if not hasattr(loss, "vocab_size"):
            raise ValueError(f"{type(loss).__name__} has no vocab_size; the vocab_loss style needs one")
        return cls(loss.vocab_size, group, getattr(loss, "kernel_for", None))

    def forward(self, hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, reduction: str) -> torch.Tensor:
        kernel = self.kernel_for(hidden) if self.kernel_for is not None else None
        if kernel is None:
            return vocab_parallel_cross_entropy(head(hidden), labels, self.vocab_size, self.group, reduction)
        # the head's own input step (ColumnParallelLinear), then the projection inside the kernel
        x = gather_sequence(hidden, self.group) if head.sequence_parallel else copy_to_tp(hidden, self.group)
        local_vocab = head.weight.shape[0]
        return kernel(x, head.weight, labels, self.vocab_size, reduction, dist.get_rank(self.group) * local_vocab,
                      _combine(self.group))
