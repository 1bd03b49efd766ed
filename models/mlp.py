"""The position-wise MLP: GeLU (GPT-2, MT-NLG) or SwiGLU (Llama).

For SwiGLU the gate and up projections are one fused ``fc_in`` whose output rows interleave
``gate_0, up_0, gate_1, up_1, ...``; a contiguous split of those rows (column parallelism) then
hands each rank matching gate and up units, and the model needs no knowledge of the split.
"""

from __future__ import annotations

import torch
from torch import nn

from models import ops
from models.config import ModelConfig

ACTIVATIONS = ("gelu", "gelu_exact", "swiglu")  # the values of model.activation


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.gated = cfg.activation == "swiglu"
        self.exact_gelu = cfg.activation == "gelu_exact"
        if cfg.activation not in ACTIVATIONS:
            raise ValueError(f"model.activation: unknown activation {cfg.activation!r}; use one of {', '.join(ACTIVATIONS)}")
        inner = cfg.ffn_size * (2 if self.gated else 1)
        self.fc_in = nn.Linear(cfg.hidden_size, inner, bias=cfg.bias, device=device)
        self.fc_out = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=cfg.bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc_in(x)
        if self.gated:
            pairs = h.unflatten(-1, (-1, 2))
            h = ops.swiglu(pairs[..., 0], pairs[..., 1])
        else:
            h = ops.gelu(h, exact=self.exact_gelu)
        return self.fc_out(h)
