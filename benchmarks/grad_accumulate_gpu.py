"""How fast 16-bit gradients can land in the fp32 gradient buffer, by each way torch offers.

Every micro-batch, each parameter's bf16 gradient is copied (the step's first micro-batch) or added
(the others) into its fp32 region of the data-parallel buffer. On an H200 with torch 2.11 a 1.3B
GPT's copies took 4.9 ms a step, about a third of the memory bandwidth: torch casts bf16 to fp32
with its unvectorized kernel (BENCHMARKS.md, "Where tensor parallel's step goes"). This times, over
the parameter shapes of a config's model, the ways to do it: ``copy_`` / ``add_`` per parameter (what
the buffer does now), ``torch._foreach_copy_`` / ``_foreach_add_`` per parameter and for all at once,
and the weight-gradient GEMM accumulating into the fp32 buffer itself (``addmm`` with an fp32
output, Megatron's gradient-accumulation fusion) against the GEMM followed by the add; each as
milliseconds per step and GB/s of its minimal traffic::

    python benchmarks/grad_accumulate_gpu.py configs/gpt_1.3b.yaml
"""

from __future__ import annotations

import argparse
import json

import torch

from megazero.config import load_config
from models import GPT


def timed(fn, repeats: int = 20) -> float:
    """Median milliseconds of ``fn`` on the GPU."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


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

    runs = {
        "copy_": (per_param(lambda r, g: r.copy_(g)), copy_bytes),
        "foreach_copy_ per parameter": (per_param(lambda r, g: torch._foreach_copy_([r], [g])), copy_bytes),
        "foreach_copy_ all": (lambda: torch._foreach_copy_(regions, grads), copy_bytes),
        "add_": (per_param(lambda r, g: r.add_(g)), add_bytes),
        "foreach_add_ all": (lambda: torch._foreach_add_(regions, grads), add_bytes),
    }
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "parameters": numel}
    for name, (fn, nbytes) in runs.items():
        ms = timed(fn)
        result[name] = {"ms": round(ms, 3), "GB_per_s": round(nbytes / ms / 1e6)}
    # the first MLP weight's gradient, [out, in] from [tokens, out]^T @ [tokens, in]
    n_out, n_in = dict(model.named_parameters())["layers.0.mlp.fc_in.weight"].shape
    out_grad = torch.randn(args.tokens, n_out, device=device, dtype=torch.bfloat16)
    inputs = torch.randn(args.tokens, n_in, device=device, dtype=torch.bfloat16)
    main_grad = torch.randn(n_out, n_in, device=device)
    result["wgrad then add_"] = {"ms": round(timed(lambda: main_grad.add_(out_grad.t() @ inputs)), 3)}
    fused = lambda: torch.addmm(main_grad, out_grad.t(), inputs, out_dtype=torch.float32, out=main_grad)  # noqa: E731
    try:
        expected = main_grad + out_grad.t().float() @ inputs.float()
        fused()
        error = ((main_grad - expected).norm() / expected.norm()).item()
        result["wgrad into fp32 (addmm out_dtype)"] = {"ms": round(timed(fused), 3), "rel_error": error}
    except (RuntimeError, TypeError) as exc:  # torch before late 2025 wants self in the inputs' dtype
        result["wgrad into fp32 (addmm out_dtype)"] = f"unavailable: {exc}".splitlines()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
