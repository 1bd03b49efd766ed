"""Every fused body of the ops seam against its torch reference, forward and backward, on one GPU.

Inputs are fresh random draws (never zeros); each op's gradient is taken of a random weighting of
its output, so every element of the backward is checked. Tolerances, as ||fused - ref|| / ||ref||:

* fp32: the reference runs on the same fp32 inputs; outputs within 1e-5, gradients within 1e-4
  (the fused cross-entropy sums its weight gradient over chunks in another order);
* bf16: both the fused body and the torch reference run in bf16 and are compared with the
  reference in fp32 on the same (upcast) inputs; the fused body's error must stay within 1.5x
  torch's own bf16 error, or under 1e-2 where torch's is smaller than bf16 rounding can show.

Also checked: the fused cross-entropy over several chunks, with ignored labels and padding columns,
for both reductions: ``"none"`` under per-token weights that differ (the exact backward, which runs
the chunks again) and ``"sum"`` under a random scalar (the backward only rescales: the chunks run
once); the GPT's loss and gradients with the fused bodies on and off, eager and compiled, the
loss's chunks run once per step; the vocabulary-parallel form on two ranks (gloo on one GPU)
against the full-vocabulary loss, both reductions. Skipped without a CUDA device and Triton.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models import GPT, kernels, ops
from models.config import ModelConfig
from models.presets import MODEL_PRESETS

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not (torch.cuda.is_available() and kernels.NEEDS["triton"]),
                                 reason="needs a CUDA device and Triton")]

DTYPES = (torch.float32, torch.bfloat16)
FP32_OUT, FP32_GRAD, BF16_FLOOR, BF16_FACTOR = 1e-5, 1e-4, 1e-2, 1.5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values in the fused result"
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def run(fn, inputs, weight_out):
    """fn(*inputs) and the gradients of sum(out * weight_out) for every input that requires one."""
    leaves = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    out = fn(*leaves)
    (out.float() * weight_out).sum().backward()
    return [out] + [x.grad for x in leaves if x.requires_grad]


def check(fused, reference, inputs, dtype):
    """Compare ``fused`` with ``reference`` on ``inputs`` (given in fp32) cast to ``dtype``."""
    cast = [x.to(dtype) if x.is_floating_point() else x for x in inputs]
    for x, c in zip(inputs, cast):
        c.requires_grad_(x.requires_grad)
    probe = reference(*cast)
    weight_out = torch.randn(probe.shape, device=probe.device)
    got = run(fused, cast, weight_out)
    if dtype == torch.float32:
        want = run(reference, cast, weight_out)
        errors = [rel(g, w) for g, w in zip(got, want)]
        assert errors[0] < FP32_OUT and max(errors[1:], default=0.0) < FP32_GRAD, errors
        return
    upcast = [c.detach().float().requires_grad_(x.requires_grad) if x.is_floating_point() else c
              for x, c in zip(inputs, cast)]
    exact = run(reference, upcast, weight_out)
    torch_bf16 = run(reference, cast, weight_out)
    for name, g, t, e in zip(("output", *(f"grad {i}" for i in range(len(got) - 1))), got, torch_bf16, exact):
        ours, theirs = rel(g, e), rel(t, e)
        assert ours <= max(BF16_FACTOR * theirs, BF16_FLOOR), f"{name}: fused {ours:.2e}, torch bf16 {theirs:.2e}"


def randn(*shape, grad=True, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).requires_grad_(grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype):
    if not kernels.NEEDS["liger"]:
        pytest.skip("liger-kernel is not importable")
    from models.kernels import liger
    x, w = randn(4, 96, 1024, scale=3.0), randn(1024, scale=0.5)
    check(lambda x, w: liger.rms_norm(x, w, 1e-5), lambda x, w: ops.rms_norm.reference(x, w, 1e-5), [x, w], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", ["layernorm", "layernorm without bias", "rmsnorm"])
def test_residual_add_and_norm(dtype, norm):
    """Both outputs (the residual sum and its norm) get a gradient, as in the block; a row width
    that is not a power of two leaves masked columns in every row."""
    from models.kernels import norms
    x, branch, w, b = randn(4, 96, 1000), randn(4, 96, 1000, scale=2.0), randn(1000, scale=0.5), randn(1000)

    def both(fn):
        return lambda *a: torch.stack([t.to(a[0].dtype) for t in fn(*a)])
    if norm == "rmsnorm":
        check(both(lambda x, r, w: norms.add_rms_norm(x, r, w, 1e-5)),
              both(lambda x, r, w: ops.add_rms_norm.reference(x, r, w, 1e-5)), [x, branch, w], dtype)
    elif norm == "layernorm":
        check(both(lambda x, r, w, b: norms.add_layer_norm(x, r, w, b, 1e-5)),
              both(lambda x, r, w, b: ops.add_layer_norm(x, r, w, b, 1e-5)), [x, branch, w, b], dtype)
    else:
        check(both(lambda x, r, w: norms.add_layer_norm(x, r, w, None, 1e-5)),
              both(lambda x, r, w: ops.add_layer_norm(x, r, w, None, 1e-5)), [x, branch, w], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_on_interleaved_projection(dtype):
    """The MLP hands over gate and up as the even and odd columns of one projection."""
    from models.kernels import elementwise

    def split(fn):
        return lambda h: fn(h.unflatten(-1, (-1, 2))[..., 0], h.unflatten(-1, (-1, 2))[..., 1])
    h = randn(3, 77, 2 * 1400, scale=2.0)
    check(split(elementwise.swiglu), split(ops.swiglu.reference), [h], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_qkv_slices(dtype):
    """q and k are strided slices of the fused qkv projection (2 kv groups of 3 query heads)."""
    from models.kernels import elementwise
    batch, seq, groups, r, dim = 2, 80, 2, 3, 64
    qkv = randn(batch, seq, groups, r + 2, dim)
    cos, sin = ops.rotary_tables(seq, dim, 10000.0, "cuda", torch.float32)

    def on(fn, part):
        def f(qkv, cos, sin):
            x = qkv[..., :r, :].flatten(2, 3) if part == "q" else qkv[..., r, :]
            return fn(x, cos.to(qkv.dtype), sin.to(qkv.dtype))
        return f
    for part in ("q", "k"):
        check(on(elementwise.apply_rotary, part), on(ops.apply_rotary.reference, part),
              [qkv, cos.requires_grad_(False), sin.requires_grad_(False)], dtype)


def _needs_flash_attention() -> None:
    if not (kernels.HAS_FLASH and torch.cuda.get_device_capability()[0] == 9):
        pytest.skip("needs flash-attn-4 and a Hopper GPU")


def _heads(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the model hands them to the seam: strided views of qkv [batch, seq, groups, r + 2, dim]."""
    r = qkv.shape[3] - 2
    return (qkv[..., :r, :].flatten(2, 3).transpose(1, 2), qkv[..., r, :].transpose(1, 2),
            qkv[..., r + 1, :].transpose(1, 2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("groups,r,dim", [(4, 1, 128), (2, 3, 64), (1, 4, 96)])
def test_flash_attention_on_qkv_views(dtype, groups, r, dim):
    """FlashAttention 4 on the model's q, k, v views (multi-head, and grouped-query with 3 and 4 query
    heads a group; head sizes 128, 64, 96) against SDPA; 200 positions leave a part-filled last tile."""
    _needs_flash_attention()
    from models.kernels import flash_attention
    qkv = randn(2, 200, groups, r + 2, dim)
    check(lambda qkv: flash_attention.attention(*_heads(qkv)),
          lambda qkv: ops.attention.reference(*_heads(qkv), 0.0), [qkv], dtype)


def test_flash_attention_is_chosen_where_it_applies_and_is_deterministic():
    """The seam runs it for bf16 and fp16 without dropout and with enough (batch, head) pairs (half a
    pair per multiprocessor), SDPA otherwise; its backward gives the same bits twice; compiled whole (one
    graph) it gives the eager op's output and gradient."""
    _needs_flash_attention()
    heads = torch.cuda.get_device_properties(0).multi_processor_count
    q = torch.zeros(1, heads, 8, 64, device="cuda", dtype=torch.bfloat16)
    assert kernels.use_flash_attention(q, 0.0) and kernels.use_flash_attention(q.half(), 0.0)
    assert not kernels.use_flash_attention(q, 0.1) and not kernels.use_flash_attention(q.float(), 0.0)
    assert kernels.use_flash_attention(q[:, :(heads + 1) // 2], 0.0)
    assert not kernels.use_flash_attention(q[:, :(heads + 1) // 2 - 1], 0.0)
    qkv = randn(1, 256, heads, 3, 128).to(torch.bfloat16).detach().requires_grad_(True)
    weight = torch.randn(1, heads, 256, 128, device="cuda")
    grads = []
    for fn in (ops.attention, ops.attention, torch.compile(ops.attention, fullgraph=True)):
        qkv.grad = None
        out = fn(*_heads(qkv), 0.0)
        (out.float() * weight).sum().backward()
        grads.append((out.detach(), qkv.grad.clone()))
    assert torch.equal(grads[0][1], grads[1][1]), "two backward passes differ"
    for eager, compiled in zip(grads[0], grads[2]):
        assert torch.equal(eager, compiled)


def _linear_ce_inputs(tokens=(3, 250), hidden=64, vocab=1100, padded=1152, ignored=17):
    h, w = randn(*tokens, hidden), randn(padded, hidden, scale=0.3)
    labels = torch.randint(0, vocab, tokens, device="cuda")
    labels.view(-1)[torch.randperm(labels.numel(), device="cuda")[:ignored]] = ops.IGNORE_INDEX
    labels.view(-1)[0] = vocab - 1
    return h, w, labels, vocab


def count_chunk_runs(monkeypatch) -> list:
    """Record each run of the fused cross-entropy's chunk loop (once in forward; again in backward
    only on the exact path)."""
    from models.kernels import cross_entropy
    runs, original = [], cross_entropy._run_chunks

    def counted(*args, **kwargs):
        runs.append(args[0].shape)
        return original(*args, **kwargs)
    monkeypatch.setattr(cross_entropy, "_run_chunks", counted)
    return runs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_linear_cross_entropy_chunks_ignored_labels_and_padding(dtype, reduction, monkeypatch):
    """``check`` weights each token's loss at random ("none": the exact path, the chunks run again in
    backward) or scales the sum by a random scalar ("sum": the chunks run once, in forward)."""
    from models.kernels import cross_entropy
    monkeypatch.setattr(cross_entropy, "CHUNK_ELEMENTS", 128 * 1152)  # 128-row chunks: 6, the last partial
    runs = count_chunk_runs(monkeypatch)
    h, w, labels, vocab = _linear_ce_inputs()
    fused = lambda h, w: cross_entropy.linear_cross_entropy(h, w, labels, vocab, reduction)
    reference = lambda h, w: ops.linear_cross_entropy.reference(h, w, labels, vocab, reduction)
    check(fused, reference, [h, w], dtype)
    assert len(runs) == (2 if reduction == "none" else 1), runs
    loss = fused(h.to(dtype), w.to(dtype))
    if reduction == "none":
        assert (loss[labels == ops.IGNORE_INDEX] == 0).all()
    else:
        assert loss.shape == () and loss.dtype == torch.float32


def test_summed_linear_cross_entropy_scales_bf16_gradients_in_fp32():
    """Backward of the summed loss divided by 3 (a token count that is no power of two): the factor
    must reach the bf16 gradient unrounded. Rounded to bf16 first, 1/3 becomes 0.333984375 and every
    gradient is 0.195% too large, which the elementwise tolerance of ``check`` cannot see, but the
    median ratio to an fp32 reference does."""
    from models.kernels import cross_entropy
    h, w, labels, vocab = _linear_ce_inputs()
    hb, wb = h.detach().to(torch.bfloat16).requires_grad_(True), w.detach().to(torch.bfloat16)
    (cross_entropy.linear_cross_entropy(hb, wb, labels, vocab, "sum") / 3).backward()
    hf = hb.detach().float().requires_grad_(True)
    (ops.linear_cross_entropy.reference(hf, wb.float(), labels, vocab, "sum") / 3).backward()
    big = hf.grad.abs() > hf.grad.abs().median()
    ratio = (hb.grad.float()[big] / hf.grad[big]).median().item()
    assert abs(ratio - 1) < 5e-4, ratio


def _gpt(preset: str, dtype) -> GPT:
    cfg = ModelConfig(num_layers=2, hidden_size=128, num_heads=4, vocab_size=1000, seq_length=64,
                      **MODEL_PRESETS[preset])
    if preset == "llama":
        cfg = dataclasses.replace(cfg, num_kv_heads=2)
    return GPT(cfg, seed=3, device="cuda").to(dtype)


@pytest.mark.parametrize("preset", ["gpt2", "llama"])
@pytest.mark.parametrize("compiled", [False, True])
def test_gpt_loss_and_gradients_with_and_without_kernels(preset, compiled, monkeypatch):
    """The whole model in bf16 with every fused body on, against the same weights with all off."""
    monkeypatch.setattr(kernels, "FLASH_PAIRS_PER_MULTIPROCESSOR", 0)  # FlashAttention 4 too, where installed
    tokens = torch.randint(0, 1000, (4, 64), device="cuda")
    labels = torch.randint(0, 1000, (4, 64), device="cuda")
    labels[0, :5] = ops.IGNORE_INDEX
    results = {}
    runs = count_chunk_runs(monkeypatch)
    for enabled in (True, False):
        monkeypatch.setattr(kernels, "ENABLED", enabled)
        torch._dynamo.reset()
        model = _gpt(preset, torch.bfloat16)
        forward = torch.compile(model) if compiled else model
        loss = forward(tokens, labels, reduction="sum") / (labels != ops.IGNORE_INDEX).sum()
        loss.backward()
        results[enabled] = (loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()})
    assert len(runs) == 1, "the engine's summed loss must run the fused chunks once, in forward only"
    (loss_on, grads_on), (loss_off, grads_off) = results[True], results[False]
    assert rel(loss_on, loss_off) < 1e-2
    worst = max((rel(grads_on[n], grads_off[n]), n) for n in grads_off)
    assert worst[0] < 3e-2, worst


def _vocab_parallel(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch import nn

    from parallel.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

    torch.manual_seed(0)
    h, w, labels, vocab = _linear_ce_inputs(tokens=(2, 200), vocab=1000, padded=1024)
    labels[0, :3] = vocab - 1  # in the second rank's slice, next to its padding
    head = nn.Module()
    head.weight = nn.Parameter(w.detach().chunk(world)[rank].clone())
    head.sequence_parallel = False
    assert ops.fused_linear_cross_entropy(h) is not None
    errors = {}
    weights = torch.rand(labels.shape, device="cuda")
    # per-token weights (the exact backward) and the engine's sum over tokens (the rescaling one)
    for reduction, scale in (("none", lambda loss: (loss * weights).sum()), ("sum", lambda loss: loss / 7)):
        head.weight.grad = None
        x = h.detach().clone().requires_grad_(True)
        loss_fn = VocabParallelCrossEntropy(vocab, dist.group.WORLD, ops.fused_linear_cross_entropy)
        loss = loss_fn(x, head, labels, reduction)
        scale(loss).backward()
        parts = [torch.empty(head.weight.shape) for _ in range(world)]
        dist.all_gather(parts, head.weight.grad.float().cpu())
        ref_x, ref_w = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
        ref = ops.linear_cross_entropy.reference(ref_x, ref_w, labels, vocab, reduction)
        scale(ref).backward()
        errors[reduction] = {"loss": rel(loss, ref), "grad_x": rel(x.grad, ref_x.grad),
                             "grad_w": rel(torch.cat(parts), ref_w.grad.cpu())}
    return errors


def test_vocab_parallel_linear_cross_entropy_on_two_ranks():
    from tests.distributed import run_world
    for result in run_world(2, _vocab_parallel, timeout=240):
        for e in result.values():
            assert e["loss"] < FP32_OUT and e["grad_x"] < FP32_GRAD and e["grad_w"] < FP32_GRAD, result
