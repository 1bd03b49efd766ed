"""LayerNorm and RMSNorm with their parameters under the names ``weight`` (and ``bias``).

``norm(x)`` normalises x; ``norm(x, branch)`` returns the residual sum ``x + branch`` and its norm,
one fused op on GPU (see ``models.ops.add_layer_norm``). The sum goes through the module's own call,
not another method, so what wraps a module's forward (ZeRO-3's gathers, sequence parallelism's
gradient reduction of the weight) applies to it as well.
"""

from __future__ import annotations

from typing import Optional

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

    def forward(self, x: torch.Tensor, branch: Optional[torch.Tensor] = None):
        if branch is None:
            return ops.layer_norm(x, self.weight, self.bias, self.eps)
        return ops.add_layer_norm(x, branch, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width, device=device))

    def forward(self, x: torch.Tensor, branch: Optional[torch.Tensor] = None):
        if branch is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, branch, self.weight, self.eps)


NORMS = (LayerNorm, RMSNorm)
NORM_KINDS = ("layernorm", "rmsnorm")  # the values of model.norm, in build_norm's order


def build_norm(cfg: ModelConfig, device=None) -> nn.Module:
    """The config's norm; LayerNorm carries a bias exactly when the linear layers do."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.hidden_size, cfg.norm_eps, device=device)
    if cfg.norm == "layernorm":
        return LayerNorm(cfg.hidden_size, cfg.norm_eps, bias=cfg.bias, device=device)
    raise ValueError(f"model.norm: unknown norm {cfg.norm!r}; use one of {', '.join(NORM_KINDS)}")
