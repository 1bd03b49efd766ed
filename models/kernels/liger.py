"""RMSNorm from liger-kernel (an optional dependency, imported on first use).

liger's Triton RMSNorm runs forward and backward as one kernel each (torch's eager one is six),
keeps the inverse RMS in fp32 and casts the normalised activations before the weight multiplies them
(``casting_mode="llama"``), which is exactly ``models.ops.rms_norm``'s reference. The backward
writes a fresh gradient (``in_place=False``): the incoming one may be read again by the residual
branch.
"""

from __future__ import annotations

import torch


def load_rms_norm():
    """liger's RMSNorm function, imported when a run starts (``kernels.settle_kernels``) or at first use."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return LigerRMSNormFunction


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return load_rms_norm().apply(x, weight, eps, 0.0, "llama", False)

