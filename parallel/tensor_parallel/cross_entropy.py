"""Cross-entropy over vocabulary-split logits, without ever gathering the full logits.

Each rank holds logits for its vocabulary slice ``[start, start + V/tp)``. The loss
``log(sum_j exp(z_j)) - z_label`` needs three reductions over the vocabulary: the max (for
stability; no gradient flows through it), the sum of exponentials and the label's logit (held by
exactly one rank). Both sums go through ``reduce_from_tp`` (all-reduce forward, identity
backward), so autograd gives each rank the gradient of its own slice: softmax minus one-hot.
Columns at or past ``vocab_size`` (the padding) are set to -inf: they add nothing to the sum and
receive no gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from parallel import comm
from parallel.tensor_parallel.collectives import reduce_from_tp


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, group,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss (fp32, shaped like ``labels``; 0 where ``labels == ignore_index``)."""
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
    return (sum_exp.log() - label_logit).masked_fill(ignored, 0.0)


class VocabParallelCrossEntropy(nn.Module):
    """Drop-in for a per-token loss module taking (logits, labels) over a padded vocabulary."""

    def __init__(self, vocab_size: int, group):
        super().__init__()
        self.vocab_size = vocab_size
        self.group = group

    @classmethod
    def from_loss(cls, loss: nn.Module, group, sequence_parallel: bool = False, memo=None):
        if not hasattr(loss, "vocab_size"):
            raise ValueError(f"{type(loss).__name__} has no vocab_size; the vocab_loss style needs one")
        return cls(loss.vocab_size, group)

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels, self.vocab_size, self.group)
