"""Per-kernel table on one GPU: each fused body of the ops seam against its torch reference, eager and
compiled, forward and forward+backward, at the shapes of the 1.3B models (micro-batch 8, sequence
2048: 16,384 tokens of width 2048); plus the SDPA backends and FlashAttention 4 (where installed) for
causal and grouped-query attention,
(``--only gelu_profile``) the kernels inductor makes of the GPT-2 MLP's bias + GeLU, and
(``--only bias_grad``) ways to sum a split backward's bias gradients.

    python benchmarks/kernels_gpu.py [--json FILE]

Times are medians of ``triton.testing.do_bench`` (CUDA events) in milliseconds. "fwd" is the forward
pass as in training (inputs that require grad: the fused cross-entropy, asked for the sum over
tokens, does its gradient GEMMs there and its backward only scales); "peak MiB" is what a
forward+backward allocates beyond its inputs. liger-kernel's own fused linear cross-entropy, SwiGLU
and RoPE are timed beside ours where it has one, when importable.
"""

from __future__ import annotations

import argparse
import json
from typing import Callable, Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from models import kernels, ops

TOKENS, HIDDEN, VOCAB, PADDED, HEADS, FFN = 8 * 2048, 2048, 50257, 50304, 16, 5504


def time_ms(fn: Callable, inputs: list[torch.Tensor], backward: bool) -> tuple[float, float]:
    """Median time of fn (and its backward) and the peak memory it allocates beyond the inputs."""
    grad_out = None

    def step():
        nonlocal grad_out
        out = fn(*inputs)
        if backward:
            if grad_out is None:
                grad_out = torch.randn_like(out)
            out.backward(grad_out)
    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    grads = [x for x in inputs if x.requires_grad]
    return do_bench(step, warmup=25, rep=100, grad_to_none=grads or None, return_mode="median"), peak


def row(op: str, variant: str, fn: Callable, inputs: list[torch.Tensor]) -> Optional[dict]:
    try:
        fwd, _ = time_ms(lambda *a: fn(*a).detach(), inputs, backward=False)
        both, peak = time_ms(fn, inputs, backward=True)
    except Exception as exc:  # a variant that cannot run here is reported, not fatal
        print(f"{op:22s} {variant:24s} failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        return None
    print(f"{op:22s} {variant:24s} fwd {fwd:8.3f} ms   fwd+bwd {both:8.3f} ms   peak {peak:8.0f} MiB", flush=True)
    return {"op": op, "variant": variant, "fwd_ms": round(fwd, 3), "fwd_bwd_ms": round(both, 3),
            "peak_MiB": round(peak)}


def compare(op: str, reference: Callable, fused: Optional[Callable], inputs: list[torch.Tensor],
            extra: dict[str, Callable] = {}) -> list[dict]:
    variants = {"torch eager": reference, "torch.compile": torch.compile(reference)}
    if fused is not None:
        variants["megazero fused"] = fused
    variants.update(extra)
    return [r for name, fn in variants.items() if (r := row(op, name, fn, inputs)) is not None]


def leaf(*shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype).requires_grad_(True)


def cross_entropy_rows() -> list[dict]:
    from models.kernels.cross_entropy import linear_cross_entropy
    hidden, weight = leaf(TOKENS, HIDDEN), leaf(PADDED, HIDDEN, scale=0.02)
    labels = torch.randint(0, VOCAB, (TOKENS,), device="cuda")

    extra = {}
    if kernels.NEEDS["liger"]:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
        # the padded weight, as ours gets, so rows of logits stay 16-byte aligned (padding is counted)
        extra["liger (sum)"] = lambda h, w: LigerFusedLinearCrossEntropyFunction.apply(
            h, w, labels, None, None, -100, 0.0, 0.0, "sum")[0]
    # the loss summed over tokens, as training asks for it
    return compare("linear_cross_entropy", lambda h, w: ops.linear_cross_entropy.reference(h, w, labels, VOCAB, "sum"),
                   lambda h, w: linear_cross_entropy(h, w, labels, VOCAB, "sum"), [hidden, weight], extra)


def cross_entropy_tiles() -> list[dict]:
    """The fused cross-entropy's row kernel per tile width and warp count (alone, on one chunk of
    logits: GB/s counts its read of the stats pass and the read and write of the gradient pass), then
    the whole forward+backward per chunk size, at the 125M (16 x 2048 tokens, hidden 768) and 1.3B
    shapes."""
    from models.kernels import cross_entropy, cross_entropy_rows as rows_module
    from models.kernels.cross_entropy import linear_cross_entropy
    out = []
    logits = torch.randn(4096, PADDED, device="cuda").to(torch.bfloat16)
    labels = torch.randint(0, VOCAB, (4096,), device="cuda")
    scale, loss = torch.ones(4096, device="cuda"), torch.empty(4096, device="cuda")
    default, default_chunk = (rows_module.ROW_BLOCK, rows_module.ROW_WARPS), cross_entropy.CHUNK_ELEMENTS
    try:
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16, 32):
                rows_module.ROW_BLOCK, rows_module.ROW_WARPS = block, warps
                ms = do_bench(lambda: rows_module.loss_and_grad(logits, labels, scale, loss, 0, VOCAB, None, True),
                              warmup=10, rep=50, return_mode="median")
                gbs = 3 * logits.numel() * 2 / ms / 1e6
                print(f"row kernel BLOCK {block:5d} warps {warps:2d}  {ms:7.3f} ms  {gbs:6.0f} GB/s", flush=True)
                out.append({"op": "ce_rows", "block": block, "warps": warps, "ms": round(ms, 4), "GBps": round(gbs)})
        rows_module.ROW_BLOCK, rows_module.ROW_WARPS = default
        for name, tokens, hidden in (("125m", 16 * 2048, 768), ("1.3b", TOKENS, HIDDEN)):
            h, w = leaf(tokens, hidden), leaf(PADDED, hidden, scale=0.02)
            target = torch.randint(0, VOCAB, (tokens,), device="cuda")
            for log2 in (27, 28, 29, 30):
                cross_entropy.CHUNK_ELEMENTS = 2 ** log2
                r = row("linear_cross_entropy", f"{name} chunk 2^{log2}",
                        lambda a, b: linear_cross_entropy(a, b, target, VOCAB, "sum"), [h, w])
                out += [r] if r else []
            del h, w
    finally:  # the module defaults, whatever failed
        (rows_module.ROW_BLOCK, rows_module.ROW_WARPS), cross_entropy.CHUNK_ELEMENTS = default, default_chunk
    return out


def norm_rows() -> list[dict]:
    x, w, b = leaf(TOKENS, HIDDEN), leaf(HIDDEN), leaf(HIDDEN)
    fused_rms = fused_ln = None
    if kernels.NEEDS["liger"]:
        from models.kernels import liger
        fused_rms = lambda x, w: liger.rms_norm(x, w, 1e-5)
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        fused_ln = lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5)
    return (compare("rms_norm", lambda x, w: ops.rms_norm.reference(x, w, 1e-5), fused_rms, [x, w])
            + compare("layer_norm", lambda x, w, b: ops.layer_norm(x, w, b, 1e-5), None, [x, w, b],
                      {"liger": fused_ln} if fused_ln else {}))


def add_norm_rows() -> list[dict]:
    """The residual add and the norm after it (both outputs used, as in the block)."""
    from models.kernels import norms
    x, branch, w, b = leaf(TOKENS, HIDDEN), leaf(TOKENS, HIDDEN), leaf(HIDDEN), leaf(HIDDEN)

    def both(fn):  # one output to backward from: the sum and the normed, each weighted at random
        return lambda *a: torch.stack(fn(*a))
    return (compare("add + layer_norm", both(lambda x, r, w, b: ops.add_layer_norm(x, r, w, b, 1e-5)),
                    both(lambda x, r, w, b: norms.add_layer_norm(x, r, w, b, 1e-5)), [x, branch, w, b])
            + compare("add + rms_norm", both(lambda x, r, w: ops.add_rms_norm.reference(x, r, w, 1e-5)),
                      both(lambda x, r, w: norms.add_rms_norm(x, r, w, 1e-5)), [x, branch, w]))


def gelu_profile() -> list[dict]:
    """Whether inductor leaves the GPT-2 MLP's bias + GeLU as a kernel of its own: the CUDA kernels of
    one compiled fc_in -> GeLU -> fc_out forward+backward, with their time."""
    fc_in = torch.nn.Linear(HIDDEN, 4 * HIDDEN, device="cuda", dtype=torch.bfloat16)
    fc_out = torch.nn.Linear(4 * HIDDEN, HIDDEN, device="cuda", dtype=torch.bfloat16)
    mlp = torch.compile(lambda x: fc_out(ops.gelu(fc_in(x))))
    x = leaf(TOKENS, HIDDEN)
    for _ in range(3):
        mlp(x).sum().backward()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        mlp(x).sum().backward()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            ms = event.device_time_total / 1e3
            print(f"mlp kernel  {ms:8.3f} ms  {event.key[:110]}", flush=True)
            rows.append({"op": "compiled gelu mlp", "kernel": event.key, "ms": round(ms, 3)})
    return rows


def swiglu_rows() -> list[dict]:
    from models.kernels.elementwise import swiglu
    h = leaf(8, 2048, 2 * FFN)

    def pairs(fn):
        return lambda h: fn(h.unflatten(-1, (-1, 2))[..., 0], h.unflatten(-1, (-1, 2))[..., 1])
    extra = {}
    if kernels.NEEDS["liger"]:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        extra["liger (contiguous)"] = pairs(lambda g, u: LigerSiLUMulFunction.apply(g.contiguous(), u.contiguous()))
    return compare("swiglu", pairs(ops.swiglu.reference), pairs(swiglu), [h], extra)


def rotary_rows() -> list[dict]:
    from models.kernels.elementwise import apply_rotary
    qkv = leaf(8, 2048, HEADS, 3, HIDDEN // HEADS)  # one query head per kv group: the MHA layout
    cos, sin = ops.rotary_tables(2048, HIDDEN // HEADS, 10000.0, "cuda", torch.bfloat16)

    def q_and_k(fn):
        return lambda qkv: torch.cat((fn(qkv[..., 0, :], cos, sin), fn(qkv[..., 1, :], cos, sin)), dim=2)
    return compare("rotary (q and k)", q_and_k(ops.apply_rotary.reference), q_and_k(apply_rotary), [qkv])


BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
ATTENTION_SHAPES = {"mha 16x128": (8, 16, 16, 128), "mha 12x64 (125m)": (16, 12, 12, 64), "gqa 16/4x128": (8, 16, 4, 128)}
"""batch, heads, kv heads, head dim at sequence 2048: GPT 1.3B, GPT 125M, grouped-query."""


def attention_rows() -> list[dict]:
    """Causal SDPA: torch's own choice of backend, then each backend forced; then FlashAttention 4
    (the seam's body on Hopper where it fits, when flash-attn-4 is installed). Every variant gets what
    the model hands the seam: ``[batch, heads, seq, head_dim]`` views of ``[batch, seq, heads, head_dim]``
    storage (the ``qkv`` projection's layout), which FlashAttention 4 reads without a copy."""
    rows = []
    for name, (batch, heads, kv, dim) in ATTENTION_SHAPES.items():
        q, k, v = (leaf(batch, 2048, n, dim).transpose(1, 2) for n in (heads, kv, kv))
        variants = {"torch default": lambda q, k, v: ops.sdpa_attention(q, k, v, 0.0)}
        for backend, choice in BACKENDS.items():
            def attend(q, k, v, choice=choice):
                with sdpa_kernel([choice]):
                    return ops.sdpa_attention(q, k, v, 0.0)
            variants[backend] = attend
        if kernels.HAS_FLASH:
            variants["flash-attn-4"] = kernels.flash_attention.attention
        rows += [r for variant, fn in variants.items() if (r := row(f"attention {name}", variant, fn, [q, k, v]))]
    return rows


def bias_grad_rows() -> list[dict]:
    """A split backward's bias gradients (``deferred_wgrad.bias_grad``: ``dY.sum(0)`` over the tokens, at
    each GPT 1.3B linear's width) against the same sum as a GEMV through cuBLAS (``ones @ dY``), the
    GEMV accumulating into an fp32 buffer (what a W op now runs), and compiled. On a busy pipeline
    rank the reductions took 23.5 ms of a 1.05 s ZB-H2 step, at about 55% of HBM bandwidth
    (BENCHMARKS.md); each variant's largest error against an fp64 sum is shown."""
    rows = []
    for width in (3 * HIDDEN, HIDDEN, 4 * HIDDEN):
        grad = torch.randn(TOKENS, width, device="cuda").to(torch.bfloat16)
        exact = grad.double().sum(0)
        ones = torch.ones(TOKENS, device="cuda", dtype=torch.bfloat16)
        into = torch.zeros(1, width, device="cuda")
        variants = {"sum(0)": lambda g: g.sum(0), "ones @ dY": lambda g: ones @ g,
                    "torch.compile sum(0)": torch.compile(lambda g: g.sum(0)),
                    # what a W op runs now (``WeightGradQueue._bias_grad_to_sink`` into the fp32 buffer)
                    "ones @ dY added in fp32": lambda g: torch.addmm(into, ones[None], g, out_dtype=torch.float32,
                                                                      out=into)}
        for name, fn in variants.items():
            ms, _ = time_ms(fn, [grad], backward=False)
            into.zero_()  # the accumulating variant's buffer, after its timed calls
            error = (fn(grad).double().view(-1) - exact).abs().max().item()
            print(f"bias_grad {width:6d}       {name:24s} {ms:8.3f} ms   max error {error:.3g}", flush=True)
            rows.append({"op": f"bias_grad {width}", "variant": name, "fwd_ms": round(ms, 4), "max_error": error})
    return rows


SECTIONS = {"cross_entropy": cross_entropy_rows, "cross_entropy_tiles": cross_entropy_tiles, "norm": norm_rows,
            "add_norm": add_norm_rows, "swiglu": swiglu_rows, "rotary": rotary_rows, "attention": attention_rows,
            "gelu_profile": gelu_profile, "bias_grad": bias_grad_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--only", nargs="*", choices=list(SECTIONS),
                        default=["cross_entropy", "norm", "add_norm", "swiglu", "rotary", "attention"])
    args = parser.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), f"liger: {kernels.NEEDS['liger']}",
          f"flash-attn-4: {kernels.HAS_FLASH}", flush=True)
    rows = []
    for name in args.only:
        rows += SECTIONS[name]()
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
