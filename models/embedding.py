"""Token (and learned position) embeddings, and the padded vocabulary size they use."""

from __future__ import annotations

import torch
from torch import nn

from models.config import ModelConfig
from models.kv_cache import Start, positions

POSITION_EMBEDDINGS = ("learned", "rope")  # the values of model.position_embedding: a table here, or rotary in attention
VOCAB_MULTIPLE = 128
"""The vocabulary is padded to a multiple of this times tp: GEMM-friendly and evenly split."""


def padded_vocab_size(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    return -(-vocab_size // multiple) * multiple


def fit_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with exactly ``rows`` rows: padding rows (zeros) added or dropped: the
    vocabulary-padded matrices between layouts of other padding, or to the unpadded vocabulary."""
    if t.shape[0] == rows:
        return t
    if t.shape[0] > rows:
        return t[:rows]
    return torch.cat([t, torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)])



class Embedding(nn.Module):
    """ids [batch, seq] -> hidden [batch, seq, hidden], dropout applied."""

    def __init__(self, cfg: ModelConfig, padded_vocab: int, device=None):
        super().__init__()
        self.tokens = nn.Embedding(padded_vocab, cfg.hidden_size, device=device)
        self.positions = (nn.Embedding(cfg.seq_length, cfg.hidden_size, device=device)
                          if cfg.position_embedding == "learned" else None)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, ids: torch.Tensor, start: Start = 0) -> torch.Tensor:
        """``start``: the position of the first of ``ids`` (decoding after the tokens a cache holds)."""
        x = self.tokens(ids)
        if self.positions is not None:
            x = x + self.positions(positions(start, ids.shape[1], ids.device))
        return self.dropout(x)
