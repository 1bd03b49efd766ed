"""Fused GPU bodies for the ops seam (``models/ops.py``), chosen per call by the tensors' device.

Each op in ``models.ops`` keeps its plain-torch body as the reference and the CPU path; on a CUDA
tensor it asks ``use_fused`` whether a body from this package should run instead. Which op gets
which body, and why, was decided by measurement on an H100 (see ``benchmarks/kernels_gpu.py``
and BENCHMARKS.md):

| op                     | fused body                                         | inside torch.compile   |
|------------------------|----------------------------------------------------|------------------------|
| linear_cross_entropy   | ours: chunked projection + Triton row kernel       | yes, as an eager call  |
| rms_norm               | liger-kernel's Triton RMSNorm, when importable     | no: inductor fuses it  |
| add_rms_norm           | ours: residual add + RMSNorm, one kernel each way  | no: inductor fuses it  |
| swiglu, apply_rotary   | ours: one Triton kernel forward, one backward      | no: inductor fuses it  |
| layer_norm, gelu       | none: torch's eager kernels are one pass already   | (inductor's)           |
| add_layer_norm         | none: ours (``norms``) lost to torch's eager pair  | (inductor's)           |
| attention              | none: SDPA already picks cuDNN's kernel, the best  | (the same)             |

Beside the ops, ``adamw`` is the optimizer's one-pass update (AdamW on the fp32 shard that also
writes the 16-bit parameters), which ``megazero.optim`` runs when ``use_fused`` says so.

"Inside torch.compile" says whether the fused body also replaces the reference while dynamo traces
a compiled graph. Elementwise ops are left to inductor there: it fuses them with their neighbours
(the residual add, the bias, the transposes around them), which an opaque kernel would prevent.

``MEGAZERO_KERNELS=0`` in the environment turns every fused body off (the torch reference runs
everywhere), to compare or to rule the kernels out when a result looks wrong. Triton and
liger-kernel are optional: without them the reference runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

ENABLED = os.environ.get("MEGAZERO_KERNELS", "1") != "0"
"""False when MEGAZERO_KERNELS=0: every op runs its torch reference."""


HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_LIGER = HAS_TRITON and importlib.util.find_spec("liger_kernel") is not None
"""Looked up once, without importing either: dynamo reads these constants while it traces."""


NEEDS = {"triton": HAS_TRITON, "liger": HAS_LIGER}


def use_fused(x: torch.Tensor, in_graph: bool = False, needs: str = "triton") -> bool:
    """Whether a fused body should replace the torch reference for an op on ``x``.

    ``in_graph``: the body is also wanted while torch.compile traces; otherwise the reference is
    traced and inductor generates the kernel. ``needs``: the optional package the body runs on.
    """
    if not (ENABLED and x.is_cuda):
        return False
    if not in_graph and torch.compiler.is_compiling():
        return False
    return NEEDS[needs]


def call(body: str, *args, **kwargs):
    """Run ``models.kernels.<module>.<function>`` (imported on first use: Triton stays optional)."""
    module, name = body.rsplit(".", 1)
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)(*args, **kwargs)


call_between_graphs = torch.compiler.disable(call) if torch.cuda.is_available() else call
"""``call`` for bodies that also replace the reference inside a compiled region: dynamo stops its
graph there and runs the kernel (with its own Python loop and collectives) eagerly.
(Without a GPU no body runs, and importing dynamo would only slow every process's start.)"""
