"""The in-place weight-gradient GEMM the zero-bubble W ops use (``parallel.data_parallel.grads``):
``matmul_into`` writes or adds ``a @ b`` into a region of a flat fp32 gradient buffer in one GEMM,
and ``can_matmul_into`` says when that rounds no more than the autograd path it replaces (fp32
buffers only; 16-bit factors only on CUDA, where cuBLAS writes the fp32 result itself).

The region is a view at an offset of a larger buffer and one factor is transposed, as in training
(``dY^T`` against ``X``); the elements around the region must stay untouched.
"""

import pytest
import torch

from parallel.matmul import can_matmul_into, matmul_into

BF16, FP32 = torch.bfloat16, torch.float32


def test_only_fp32_buffers_and_factors_that_round_no_more_are_taken():
    fp32, bf16 = torch.ones(2, 2), torch.ones(2, 2, dtype=BF16)
    assert can_matmul_into(FP32, fp32, fp32)
    assert not can_matmul_into(FP32, bf16, bf16)  # on the CPU the product would round to 16 bits
    assert not can_matmul_into(BF16, bf16, bf16)  # a 16-bit buffer would round after every product
    assert not can_matmul_into(FP32, fp32, bf16)


def _region_case(device, dtype):
    torch.manual_seed(0)
    flat = torch.full((7 + 6 * 5 + 3,), 123.0, device=device)
    region = flat[7:37].view(6, 5)
    grads = [torch.randn(32, 6, device=device).to(dtype) for _ in range(2)]
    inputs = [torch.randn(32, 5, device=device).to(dtype) for _ in range(2)]
    return flat, region, [(g.t(), x) for g, x in zip(grads, inputs)]


@pytest.mark.parametrize("device,dtype,tol", [
    ("cpu", FP32, 1e-6),
    pytest.param("cuda", BF16, 1e-5, marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_a_region_is_written_then_accumulated_in_place(device, dtype, tol):
    flat, region, products = _region_case(device, dtype)
    assert all(can_matmul_into(FP32, a, b) for a, b in products)
    exact = [a.double() @ b.double() for a, b in products]
    matmul_into(region, *products[0], accumulate=False)  # the first gradient overwrites what was there
    assert torch.allclose(region.double(), exact[0], rtol=0, atol=tol * exact[0].abs().max())
    matmul_into(region, *products[1], accumulate=True)
    both = exact[0] + exact[1]
    assert region.dtype == FP32
    assert torch.allclose(region.double(), both, rtol=0, atol=2 * tol * both.abs().max())
    assert torch.all(flat[:7] == 123.0) and torch.all(flat[37:] == 123.0)
