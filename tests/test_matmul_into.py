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


# --- the data-parallel buffers taking a W op's products (``GradReducer.add_products``) ------------

def _reducer(group, mode="full", on_final=None):
    """A weight (6, 5) and a bias (6) in one unit, each alone in its bucket (buckets of 64 elements)."""
    from parallel.data_parallel.grads import GradReducer
    from parallel.data_parallel.layout import FlatLayout

    params = [torch.nn.Parameter(torch.zeros(6, 5)), torch.nn.Parameter(torch.zeros(6))]
    layout = FlatLayout([[30, 6]], bucket_numel=64, dp=1, dp_rank=0)
    return GradReducer(params, layout, group, FP32, mode, reduce_scatter=False, on_final=on_final,
                       max_in_flight=0)


def test_add_products_declines_what_it_cannot_add_in_place(one_rank_group):
    """``add_products`` does nothing and returns False for a sharded reducer, and for a list in which
    any pair is 16-bit on the CPU (even beside fp32 pairs): the caller then hands the gradient to
    autograd, so taking part of it would count it twice; an empty list is declined too, or the
    region's old contents would count as this step's gradient. (Planted: ``or`` for ``and`` between
    the mode and factor checks; ``any`` for ``all`` over the pairs; no check for an empty list.)"""
    _, _, products = _region_case("cpu", FP32)
    sharded = _reducer(one_rank_group, mode="sharded")
    assert not sharded.add_products(0, products)
    assert not sharded.written[0] and torch.all(sharded.shard == 0)

    full = _reducer(one_rank_group)
    assert not full.add_products(0, [])  # nothing to add must not count as the gradient arriving
    assert not full.add_products(0, [(a.to(BF16), b.to(BF16)) for a, b in products])
    assert not full.add_products(0, [products[0], tuple(t.to(BF16) for t in products[1])])
    assert not full.written[0]
    assert torch.all(full.accumulated_grad(0) == 0)  # nothing arrived: zero, not a partial sum


def test_add_products_sums_with_a_hook_delivered_gradient_and_starts_its_bucket(one_rank_group):
    """A gradient the parameter's hook delivered (its copy into the buffer queued, not yet landed) and
    a W op's products for the same parameter add up, in either order; in the step's last backward,
    products that complete a bucket start its reduction at once (``on_final`` hears of it before
    ``finish``). (Planted: the queued copy not landed first, so it later overwrote the products;
    ``_arrived`` skipped, so the bucket waited for ``finish``.)"""
    _, _, products = _region_case("cpu", FP32)
    exact = sum(a.double() @ b.double() for a, b in products)
    hooked = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))

    reducer = _reducer(one_rank_group)
    reducer._accumulate(0, hooked)  # the first gradient of the step: its copy queued
    assert 0 in reducer.copying
    assert reducer.add_products(0, products)
    torch.testing.assert_close(reducer.accumulated_grad(0).view(6, 5).double(), hooked.double() + exact,
                               rtol=1e-5, atol=1e-4)

    reducer = _reducer(one_rank_group)  # products first, then the hook's gradient
    assert reducer.add_products(0, products)
    reducer._accumulate(0, hooked)
    torch.testing.assert_close(reducer.accumulated_grad(0).view(6, 5).double(), hooked.double() + exact,
                               rtol=1e-5, atol=1e-4)

    heard = []
    reducer = _reducer(one_rank_group, on_final=heard.append)
    reducer.begin_microbatch(last=True)
    assert reducer.add_products(0, products)
    assert heard == [0]  # the weight's bucket, not the bias's
    reducer.finish()
    assert heard == [0, 1]


def test_a_bias_gradient_arrives_as_gemvs_into_its_region(one_rank_group):
    """A W op hands a bias's gradient as ``(1^T, dY)`` products: the reducer adds them into the bias's
    1-D region as ``dY.sum(0)`` over every micro-batch, with a hook-delivered gradient in either order.
    A product of another shape than the parameter's is refused: a GEMM's ``out=`` would reshape the
    region and write the transposed values. (Planted: the region viewed as the parameter's own 1-D
    shape; viewed from the factors, which took the transposed product.)"""
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(7, 6, generator=g) for _ in range(2)]
    products = [(torch.ones(1, 7), dy) for dy in grads]
    exact = sum(dy.double().sum(0) for dy in grads)
    hooked = torch.randn(6, generator=g)
    for hook_first in (True, False):
        reducer = _reducer(one_rank_group)
        if hook_first:
            reducer._accumulate(1, hooked)
        assert reducer.add_products(1, products)
        if not hook_first:
            reducer._accumulate(1, hooked)
        torch.testing.assert_close(reducer.accumulated_grad(1).double(), hooked.double() + exact, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"a product of shape \(5, 6\) for parameter 0 of shape \(6, 5\)"):
        _reducer(one_rank_group).add_products(0, [(torch.ones(5, 7), torch.ones(7, 6))])  # the weight transposed
