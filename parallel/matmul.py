"""One GEMM that writes or adds its product into a buffer of another dtype.

A weight gradient computed from 16-bit factors is usually rounded to 16 bits, then converted and
added into an fp32 accumulator: two more passes over the gradient, and a 16-bit rounding of every
micro-batch's product. cuBLAS can instead accumulate the 16-bit product in fp32 straight into the
accumulator (Megatron-LM's gradient-accumulation fusion). The data-parallel gradient buffers use it
for the zero-bubble schedules' deferred weight gradients, and the fused cross-entropy for its
chunked weight gradient.
"""

from __future__ import annotations

import torch


def can_matmul_into(dtype: torch.dtype, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``matmul_into`` adds factors ``a``, ``b`` into a ``dtype`` buffer without rounding more
    than the autograd path: only fp32 buffers (a 16-bit one would be rounded after every product),
    from fp32 factors, or 16-bit ones on CUDA (cuBLAS writes fp32; a CPU product would round to 16
    bits first)."""
    if dtype != torch.float32 or a.dtype != b.dtype:
        return False
    return a.dtype == dtype or (a.is_cuda and a.dtype in (torch.bfloat16, torch.float16))


def matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """``out = a @ b``, or ``out += a @ b``, in one GEMM written in ``out``'s dtype."""
    if a.dtype == out.dtype:
        torch.addmm(out, a, b, out=out) if accumulate else torch.mm(a, b, out=out)
    elif accumulate:
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:
        torch.mm(a, b, out_dtype=out.dtype, out=out)
