"""How fast 16-bit gradients can land in the fp32 gradient buffer, by each way torch offers.

Every micro-batch, each parameter's bf16 gradient is copied (the step's first micro-batch) or added
(the others) into its fp32 region of the data-parallel buffer. On an H200 with torch 2.11 a 1.3B
GPT's copies took 4.9 ms a step, about a third of the memory bandwidth: torch casts bf16 to fp32
with its unvectorized kernel (BENCHMARKS.md, "Where tensor parallel's step goes"). This times, over
the parameter shapes of a config's model, the ways to do it: ``copy_`` / ``add_`` per parameter (what
the buffer did before it batched its copies), ``torch._foreach_copy_`` / ``_foreach_add_`` per parameter and for all at once,
a minimal Triton kernel per parameter (load bf16, add in fp32, store: one vectorized pass) and the
same by ``torch.compile``, each as milliseconds per step (GPU time; ``host_ms`` is the host's time to
issue them) and GB/s of its minimal traffic; and, for each weight of a block, its gradient GEMM
accumulating into the fp32 buffer itself (``parallel.matmul.matmul_into``: ``addmm`` with an fp32
output, Megatron's gradient-accumulation fusion, what the zero-bubble W ops do) against the GEMM
followed by the add::

    python benchmarks/grad_accumulate_gpu.py configs/gpt_1.3b.yaml
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from megazero.config import load_config
from models import GPT
from parallel.matmul import matmul_into


def timed(fn, repeats: int = 20) -> tuple[float, float]:
    """(median GPU milliseconds of ``fn``, median host milliseconds to issue it)."""
    fn()
    gpu, host = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        host.append((time.perf_counter() - t0) * 1e3)
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    return sorted(gpu)[repeats // 2], sorted(host)[repeats // 2]


def triton_accumulate():
    """A one-pass Triton kernel: ``dst (fp32) = src (bf16)`` or ``dst += src``, one launch per tensor;
    None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def kernel(dst, src, n, ADD: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        value = tl.load(src + offsets, mask=mask).to(tl.float32)
        if ADD:
            value += tl.load(dst + offsets, mask=mask)
        tl.store(dst + offsets, value, mask=mask)

    def launch(dst: torch.Tensor, src: torch.Tensor, add: bool) -> None:
        block = 4096
        kernel[(triton.cdiv(dst.numel(), block),)](dst, src, dst.numel(), ADD=add, BLOCK=block)
    return launch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens of the weight-gradient GEMM")
    args = ap.parse_args()
    cfg = load_config(args.config, [])
    model = GPT(cfg.model, device="meta")
    shapes = [p.shape for p in model.parameters()]
    device = torch.device("cuda")
    grads = [torch.randn(s, device=device, dtype=torch.bfloat16).reshape(-1) for s in shapes]
    numel = sum(g.numel() for g in grads)
    flat = torch.zeros(numel, device=device)
    regions, offset = [], 0
    for g in grads:
        regions.append(flat[offset:offset + g.numel()])
        offset += g.numel()
    copy_bytes, add_bytes = numel * (2 + 4), numel * (2 + 4 + 4)

    def per_param(op):
        return lambda: [op(r, g) for r, g in zip(regions, grads)]

    compiled_add = torch.compile(lambda r, g: r.add_(g.float()), dynamic=True)
    runs = {
        "copy_": (per_param(lambda r, g: r.copy_(g)), copy_bytes),
        "foreach_copy_ per parameter": (per_param(lambda r, g: torch._foreach_copy_([r], [g])), copy_bytes),
        "foreach_copy_ all": (lambda: torch._foreach_copy_(regions, grads), copy_bytes),
        "add_": (per_param(lambda r, g: r.add_(g)), add_bytes),
        "foreach_add_ all": (lambda: torch._foreach_add_(regions, grads), add_bytes),
        "torch.compile add per parameter": (per_param(compiled_add), add_bytes),
    }
    launch = triton_accumulate()
    if launch is not None:
        runs["triton copy per parameter"] = (per_param(lambda r, g: launch(r, g, False)), copy_bytes)
        runs["triton add per parameter"] = (per_param(lambda r, g: launch(r, g, True)), add_bytes)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "parameters": numel}
    for name, (fn, nbytes) in runs.items():
        ms, host_ms = timed(fn)
        result[name] = {"ms": round(ms, 3), "host_ms": round(host_ms, 3), "GB_per_s": round(nbytes / ms / 1e6)}
    if launch is not None:  # the kernel's own check: both forms against torch
        check = torch.randn(3, 1000, device=device)
        src = torch.randn(3, 1000, device=device, dtype=torch.bfloat16)
        dst = check.clone()
        launch(dst, src, True)
        added = torch.equal(dst, check + src.float())
        launch(dst, src, False)
        result["triton matches torch"] = added and torch.equal(dst, src.float())
    # each weight of a block: its gradient [out, in] = [tokens, out]^T @ [tokens, in] added into its fp32
    # region by a bf16 GEMM then add_, or accumulated by the GEMM itself (``parallel.matmul.matmul_into``,
    # what the zero-bubble W ops do), with that one's error against an fp32 product
    for name, param in model.layers["0"].named_parameters():
        if param.ndim != 2:
            continue
        n_out, n_in = param.shape
        a = torch.randn(args.tokens, n_out, device=device, dtype=torch.bfloat16).t()
        b = torch.randn(args.tokens, n_in, device=device, dtype=torch.bfloat16)
        main_grad = torch.empty(n_out, n_in, device=device)
        exact = a.float() @ b.float()
        matmul_into(main_grad, a, b, accumulate=False)
        error = ((main_grad - exact).norm() / exact.norm()).item()
        result[f"wgrad {name} {n_out}x{n_in}"] = {
            "gemm then add_ ms": round(timed(lambda: main_grad.add_(a @ b))[0], 3),
            "in the GEMM ms": round(timed(lambda: matmul_into(main_grad, a, b, accumulate=True))[0], 3),
            "rel_error": error}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
