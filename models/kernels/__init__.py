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
| attention              | FlashAttention 4's CuTe kernels on Hopper, when    | yes, as a traced op    |
|                        | importable (``flash_attention``); else SDPA's own  |                        |
|                        | choice (cuDNN's kernel there)                      |                        |

Beside the ops, ``adamw`` is the optimizer's one-pass update (AdamW on the fp32 shard that also
writes the 16-bit parameters), which ``megazero.optim`` runs when ``use_fused`` says so.

"Inside torch.compile" says whether the fused body also replaces the reference while dynamo traces
a compiled graph. Elementwise ops are left to inductor there: it fuses them with their neighbours
(the residual add, the bias, the transposes around them), which an opaque kernel would prevent.

``MEGAZERO_KERNELS=0`` in the environment turns every fused body off (the torch reference runs
everywhere), to compare or to rule the kernels out when a result looks wrong. Triton, liger-kernel
and flash-attn-4 are optional: without them the reference runs (flash-attn-4 only at the releases of
``FLASH_VERSIONS``; the trainer says so when another is installed).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
from typing import Optional

import torch

ENABLED = os.environ.get("MEGAZERO_KERNELS", "1") != "0"
"""False when MEGAZERO_KERNELS=0: every op runs its torch reference."""


def _installed(package: str) -> bool:
    """Whether ``package`` can be found, without importing it."""
    return importlib.util.find_spec(package) is not None


NEEDS = {"triton": _installed("triton"), "liger": _installed("triton") and _installed("liger_kernel")}
"""Whether each optional package a body runs on (``use_fused``'s ``needs``) is there to run it: looked
up once, without importing either, since dynamo reads it while it traces; ``settle_kernels`` turns one
off whose import fails. The one record of it: every reader (and a test standing in another machine)
goes through this dict, so no second copy can disagree with what ``use_fused`` chooses."""


FLASH_VERSIONS = ("4.0.0b36",)
"""The flash-attn-4 releases the attention seam runs: it calls the package's forward and backward
functions below its public API (``flash_attention.load_interface``), whose arguments a later release
may change, so only releases it was tested and measured with are used (the ``flash`` extra pins one)."""


def _flash_attention_4_version() -> Optional[str]:
    """The installed flash-attn-4's version: None when its files (``flash_attn/cute``) are absent, ""
    when they are there without the package's record (a source tree). Found without importing
    ``flash_attn``: it may be FlashAttention 2's package, whose import loads its CUDA extension."""
    spec = importlib.util.find_spec("flash_attn")
    if spec is None or not any(os.path.isfile(os.path.join(folder, "cute", "interface.py"))
                               for folder in spec.submodule_search_locations or ()):
        return None
    try:
        return importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _flash_attention_unused(version: Optional[str]) -> Optional[str]:
    """Why an installed flash-attn-4 is not used (one line for the run's log), None when it is or
    when none is installed."""
    if version is None or version in FLASH_VERSIONS:
        return None
    return (f"flash-attn-4 {version or '(a source tree: no version recorded)'} is installed, but megazero "
            f"runs only {', '.join(FLASH_VERSIONS)} (it calls functions outside the package's public API), so "
            "attention runs SDPA; pip install -e '.[flash]' installs that release")


FLASH_VERSION = _flash_attention_4_version()
HAS_FLASH = FLASH_VERSION in FLASH_VERSIONS


def settle_kernels(device: torch.device) -> list[str]:
    """Settle, before the first step, which optional kernel packages the seam runs on ``device``;
    returns one line for the run's log per installed package it will not run, saying why.

    The packages are imported here rather than at the first step: an install that does not import (a
    dependency missing or off the path, as after ``pip install --target``, whose ``.pth`` files Python
    never reads: flash-attn-4's CuTe DSL needs one) would otherwise fail that step with a traceback,
    after the data and the checkpoint were loaded. Where an import fails, the package is turned off
    (``HAS_FLASH``, ``NEEDS["liger"]``) and the torch body runs instead, computing the same op. Only a GPU
    matters (no body runs elsewhere), and for FlashAttention 4 only Hopper, the one GPU it runs on."""
    global HAS_FLASH
    lines = []
    if device.type != "cuda":
        return lines
    if torch.cuda.get_device_capability(device)[0] == 9:
        if HAS_FLASH and (failure := _import_failure(_body_module("flash_attention").load_interface)):
            HAS_FLASH = False
            lines.append(f"flash-attn-4 {FLASH_VERSION} is installed but does not import ({failure}), so "
                         "attention runs SDPA; reinstall it with pip install -e '.[flash]'")
        elif unused := _flash_attention_unused(FLASH_VERSION):
            lines.append(unused)
    if NEEDS["liger"] and (failure := _import_failure(_body_module("liger").load_rms_norm)):
        NEEDS["liger"] = False
        lines.append(f"liger-kernel is installed but does not import ({failure}), so rms_norm runs its torch "
                     "body; reinstall it with pip install -e '.[gpu]'")
    return lines


def _import_failure(load) -> Optional[str]:
    """Why ``load()`` failed, as "ErrorType: its first line" (the type alone for an error without a
    message), or None when it imported."""
    try:
        load()
    except Exception as exc:  # ImportError, or whatever a library it loads raises (OSError, RuntimeError)
        first = str(exc).strip().partition("\n")[0]
        return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return None


def _body_module(name: str):
    """``models.kernels.<name>``, imported on first use."""
    return importlib.import_module(f"{__name__}.{name}")


def use_flash_attention(q: torch.Tensor, dropout_p: float) -> bool:
    """Whether ``models.ops.attention`` on ``q`` [batch, heads, seq, head_dim] runs FlashAttention 4
    (``flash_attention``) rather than SDPA. Eager and compiled alike: the op is traced as one node."""
    return (ENABLED and HAS_FLASH and q.is_cuda
            and flash_attention_fits(q.shape, q.dtype, dropout_p, torch.cuda.get_device_properties(q.device)))


def flash_attention_fits(shape: torch.Size, dtype: torch.dtype, dropout_p: float, gpu) -> bool:
    """The cases FlashAttention 4 was measured faster than SDPA's cuDNN attention in a compiled
    training step (BENCHMARKS.md): a Hopper GPU (``gpu``: its device properties), bf16 or fp16, no
    dropout (the kernels have none), a head size the kernels take, and enough (batch, head) pairs to
    keep the multiprocessors busy: its deterministic backward sums each query tile's gradient in
    order, so with few pairs the multiprocessors wait on each other. On an H200 (132 of them) the
    GPT 1.3B step ran 2% slower than with SDPA at 2 x 16 pairs and 0.5-3% faster at 8 x 16 and more
    (125M, 350M, 1.3B, Llama 1.3B); the kernel alone was 1.7x slower at 2 x 32. The bound sits
    between: half a pair per multiprocessor (66 on an H200)."""
    batch, heads, _, head_dim = shape
    return (gpu.major == 9 and dtype in (torch.bfloat16, torch.float16) and dropout_p == 0.0
            and head_dim % 8 == 0 and head_dim <= 256
            and batch * heads >= FLASH_PAIRS_PER_MULTIPROCESSOR * gpu.multi_processor_count)


FLASH_PAIRS_PER_MULTIPROCESSOR = 0.5
"""``flash_attention_fits``'s least count of (batch, head) pairs, per multiprocessor (tests set 0 to run
FlashAttention 4 on small shapes)."""


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
    return getattr(_body_module(module), name)(*args, **kwargs)


call_between_graphs = torch.compiler.disable(call) if torch.cuda.is_available() else call
"""``call`` for bodies that also replace the reference inside a compiled region: dynamo stops its
graph there and runs the kernel (with its own Python loop and collectives) eagerly.
(Without a GPU no body runs, and importing dynamo would only slow every process's start.)"""


if HAS_FLASH:  # registers its custom ops; flash_attn itself is imported at their first run
    flash_attention = _body_module("flash_attention")
