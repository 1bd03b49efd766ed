"""LayerNorm and RMSNorm with their parameters under the names ``weight`` (and ``bias``)."""

from __future__ import annotations

import torch
from torch import nn

from models import ops
from models.config import ModelConfig


class LayerNorm(nn.Module):
    def __init__(self, width: int, eps: float, bias: bool = True, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width, device=device))
        self.bias = nn.Parameter(torch.zeros(width, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


NORMS = (LayerNorm, RMSNorm)
NORM_KINDS = ("layernorm", "rmsnorm")  # the values of model.norm, in build_norm's order


def build_norm(cfg: ModelConfig, device=None) -> nn.Module:
    """The config's norm; LayerNorm carries a bias exactly when the linear layers do."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.hidden_size, cfg.norm_eps, device=device)
    if cfg.norm == "layernorm":
        return LayerNorm(cfg.hidden_size, cfg.norm_eps, bias=cfg.bias, device=device)
    raise ValueError(f"model.norm: unknown norm {cfg.norm!r}; use one of {', '.join(NORM_KINDS)}")
