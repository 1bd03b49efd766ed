"""How much arithmetic a training token costs, and how much a device can do: the two halves of MFU.

FLOPs are counted from the model config alone, for the matrix multiplications (2 FLOPs per
multiply-add); norms, activations, softmax and the optimizer are left out, as in the Megatron and
PaLM papers, because they are a rounding error next to the matmuls of a large model. Per token, one
forward pass of layer ``l`` costs

    2*h*(q + 2*kv)           query, key, value projections   (q = heads*head_dim, kv = kv_heads*head_dim)
    2*s*q + 2*s*q            scores Q K^T and the weighted sum of V over all s positions
    2*q*h                    attention output projection
    2*h*f * (2 or 3)         MLP: two matrices for GeLU, three for SwiGLU  (f = ffn size)

and the LM head adds ``2*h*V``. Training costs three forward passes (backward is twice forward).
Recomputation repeats the forward of what it recomputes: all blocks under ``full`` (every
``recompute_every``-th block), the attention core (the ``4*s*q`` term) under ``selective``.

The attention term counts all ``s`` positions even though causal masking makes half of them zero,
the usual convention (Megatron's formula counts them; kernels that skip them get no credit in MFU).
For a GPT with ``ffn = 4h``, ``kv_heads = heads`` and full recompute this is exactly Megatron's
``96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))`` per batch, and without recompute it is ``6*N + 12*l*s*h``
per token with ``N`` the matmul parameters -- the tests check both. See docs/metrics.md.

The vocabulary is the tokenizer's, not the padded one: padding rows are overhead, not model work.

Peak FLOP/s come from the vendor datasheets (dense, i.e. without 2:4 sparsity), looked up by the
name CUDA reports; an unknown device has no entry and MFU is then ``None`` rather than a guess.
"""

from __future__ import annotations

import math
from typing import Optional

from models.config import ModelConfig
from models.parallelize import RECOMPUTE_MODES


def _attention_core_flops(model: ModelConfig) -> int:
    return 4 * model.seq_length * model.num_heads * model.head_dim


def _attention_half_flops(model: ModelConfig) -> int:
    """A block's attention half: its projections and its core."""
    h, q, kv = model.hidden_size, model.num_heads * model.head_dim, model.kv_heads * model.head_dim
    return 2 * h * (q + 2 * kv) + 2 * q * h + _attention_core_flops(model)


def _block_forward_flops(model: ModelConfig) -> int:
    mlp_matrices = 3 if model.activation == "swiglu" else 2
    return _attention_half_flops(model) + 2 * model.hidden_size * model.ffn_size * mlp_matrices


def attention_share(model: ModelConfig) -> float:
    """The attention half's share of a block's work (0.43 at GPT 1.3B, 0.38 at 6.7B); the MLP does the
    rest. What each side of a block cut in half by a pipeline split costs."""
    return _attention_half_flops(model) / _block_forward_flops(model)


def attention_core_share(model: ModelConfig) -> float:
    """The attention core's share of a block's forward (0.14 at GPT 1.3B): the part with no weights,
    so no weight gradient, whose backward costs more than its forward."""
    return _attention_core_flops(model) / _block_forward_flops(model)


def flops_per_token(model: ModelConfig, recompute: str = "none", recompute_every: int = 1) -> int:
    """Training FLOPs per token (forward + backward, plus recomputed forwards when asked).

    ``recompute="none"`` gives the *model* FLOPs that MFU is defined on; passing the run's
    ``parallel.recompute`` gives the *hardware* FLOPs the devices actually execute.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")
    block = _block_forward_flops(model)
    head = 2 * model.hidden_size * model.vocab_size
    total = 3 * (model.num_layers * block + head)
    if recompute == "full":
        total += math.ceil(model.num_layers / recompute_every) * block
    elif recompute == "selective":
        total += model.num_layers * _attention_core_flops(model)
    return total


def head_blocks(model: ModelConfig) -> float:
    """The LM head's matrix work in blocks' worth (``2*h*V`` against one block's forward), what the
    pipeline's default split balances: the last stage runs the head besides its blocks. Forward and
    backward scale alike and tensor parallelism splits both, so the ratio holds for the whole step."""
    return 2 * model.hidden_size * model.vocab_size / _block_forward_flops(model)


# Dense peak TFLOP/s from vendor datasheets: (name substring, {dtype: TFLOP/s}). The first substring
# found in the device name wins, so specific names come before the names they contain ("H100 PCIe"
# before "H100", "L40S" before "L40" before "L4"). fp32 is the plain (non-tensor-core) rate, which is
# what torch's default fp32 matmuls get; a dtype left out has no datasheet figure for that device.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("GH200", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    ("H200 NVL", {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0}),
    ("H200", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    ("H100 PCIE", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0}),
    ("H800 PCIE", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0}),
    ("H100", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H800", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("A800", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("V100S", {"fp16": 130.0, "fp32": 16.4}),  # "Tesla V100S-PCIE-32GB": above the V100 SXM2
    ("V100-PCIE", {"fp16": 112.0, "fp32": 14.0}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),  # SXM2; no bf16 on Volta
    ("L40S", {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6}),
    ("L40", {"bf16": 181.0, "fp16": 181.0, "fp32": 90.5}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3}),
    ("MI300X", {"bf16": 1307.4, "fp16": 1307.4, "fp32": 163.4}),
    ("MI250X", {"bf16": 383.0, "fp16": 383.0, "fp32": 47.9}),
]


def peak_flops(device_name: Optional[str], dtype: str) -> Optional[float]:
    """Dense peak FLOP/s of one device for ``dtype`` (fp32, bf16, fp16), or None when unknown."""
    if not device_name:
        return None
    name = device_name.upper()
    for substring, peaks in PEAK_TFLOPS:
        if substring.upper() in name:
            tflops = peaks.get(dtype)
            return None if tflops is None else tflops * 1e12
    return None


def device_name(device) -> Optional[str]:
    """The CUDA device name of ``device`` (a torch.device), or None on CPU, where MFU is not defined."""
    import torch

    if device.type != "cuda":
        return None
    return torch.cuda.get_device_name(device)
