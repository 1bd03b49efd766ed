"""The optimizer step alone on one GPU, per GPT size: the gradient norm, the clip, AdamW on the fp32
master and the rounding into the bf16 parameters (ZeRO stage 0, one rank), with the one-pass AdamW
kernel and with torch's fused AdamW plus the rounding copy (``MEGAZERO_KERNELS=0``), each in a
process of its own.

    python benchmarks/optimizer_step_gpu.py --sizes 125m 1.3b
    python benchmarks/optimizer_step_gpu.py --sweep     # the kernel alone, per tile size and warps
    python benchmarks/optimizer_step_gpu.py --sizes 125m --host-profile   # where the host's time goes

Prints one JSON line per (size, path): the median GPU time of ``--steps`` steps (CUDA events around
each, after 3 untimed ones; the steps are queued back to back, each after the gradients land
through the reducer's hooks as in a backward, so the host runs ahead as in training and the events
time the device's work alone), the
median host time to issue one, and the bandwidth the update's minimum traffic implies (the one-pass
kernel's: fp32 gradient, master and moments read, master and moments written, the bf16 parameter
written: 30 bytes per element; the gradient norm's read of the gradient is not counted).

``--host-profile`` adds, per (size, path), the host operations that took the most time over the timed
steps (``torch.profiler``, self CPU time per step), to see what the host spends issuing a step.

``--sweep`` times the kernel alone (``triton.testing.do_bench`` medians) over the 1.3B GPT's
stage-0 shard taken as one bucket, for each tile size and warp count, beside torch's fused AdamW
over the same segments and the rounding copy it needs after it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SIZES = {"125m": (12, 768, 12), "350m": (24, 1024, 16), "1.3b": (24, 2048, 16)}  # layers, hidden, heads


def gpt(size: str, device: str):
    from models.config import ModelConfig
    from models.gpt import GPT

    layers, hidden, heads = SIZES[size]
    return GPT(ModelConfig(preset="gpt2", num_layers=layers, hidden_size=hidden, num_heads=heads, vocab_size=50257,
                           seq_length=2048), device=device)


def measure(size: str, steps: int, host_profile: bool = False) -> dict:
    import torch
    import torch.distributed as dist

    from megazero.optim import AdamWSettings, ShardedAdamW
    from parallel.data_parallel import DataParallel, DataParallelSettings, ParamInfo

    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/pg", rank=0, world_size=1)
    model = gpt(size, "cuda")
    info = {id(p): ParamInfo(name, None, counts_for_norm=True) for name, p in model.named_parameters()}
    dp = DataParallel([model], DataParallelSettings(stage=0, param_dtype=torch.bfloat16), dist.group.WORLD,
                      units=list(model.layers.values()), info=lambda p: info[id(p)])
    opt = ShardedAdamW(dp, AdamWSettings(lr=1e-4, clip_grad=1.0))
    # bf16 gradients handed to every parameter as a backward would: the reducer's hooks land them in
    # its fp32 buffers (untimed), so the step finds every region written, as in training
    grads = [torch.randn_like(p) for p in dp.params]
    events, host_ms = [], []
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if host_profile else None
    for step in range(3 + steps):
        torch.autograd.backward(dp.params, grads)
        if step == 3 and profiler is not None:
            profiler.start()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        with torch.profiler.record_function("optimizer_step") if profiler is not None else contextlib.nullcontext():
            opt.step()
        end.record()
        if step >= 3:
            events.append((start, end))
            host_ms.append(1e3 * (time.perf_counter() - began))
    torch.cuda.synchronize()
    ms = statistics.median(start.elapsed_time(end) for start, end in events)
    numel = sum(p.numel() for p in dp.params)
    result = {"size": size, "one_pass": opt._tiles is not None, "params": numel, "step_ms": round(ms, 3),
              "host_ms": round(statistics.median(host_ms), 3), "GB_per_s": round(30 * numel / ms / 1e6)}
    if profiler is not None:
        profiler.stop()
        result["host_ms_per_step"] = _inside_steps(profiler.events(), steps)
    return result


def _inside_steps(events, steps: int) -> dict:
    """Self host time per operation name inside the ``optimizer_step`` ranges (the gradients' landing
    between steps left out), per step, the 12 largest."""
    totals: dict[str, float] = {}

    def walk(event):
        totals[event.name] = totals.get(event.name, 0.0) + event.self_cpu_time_total
        for child in event.cpu_children:
            walk(child)
    for event in events:
        if event.name == "optimizer_step":
            walk(event)
    top = sorted(totals.items(), key=lambda item: item[1], reverse=True)[:12]
    return {name: round(us / 1e3 / steps, 3) for name, us in top}


def sweep() -> None:
    import torch
    from triton.testing import do_bench

    from models.kernels import adamw
    from parallel.data_parallel import DataParallelSettings
    from parallel.data_parallel.wrapper import flat_layout

    model = gpt("1.3b", "meta")  # its stage-0 shard, taken as one bucket
    params, _, layout = flat_layout([model], list(model.layers.values()), DataParallelSettings(stage=0), 1, 0)
    segments = [(s.shard_offset, s.numel, params[s.param].dim() >= 2) for s in layout.segments]
    numel = layout.shard_numel
    grad, master = torch.randn(numel, device="cuda"), torch.randn(numel, device="cuda")
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    out = torch.empty(numel, device="cuda", dtype=torch.bfloat16)
    coef, skip = torch.tensor(0.5, device="cuda"), torch.tensor(False, device="cuda")
    corrections = torch.tensor([1 - 0.9**10, 1 - 0.95**10], device="cuda")  # step 10
    for tile in (1024, 2048, 4096, 8192):
        adamw.BLOCK = tile
        tiles = adamw.tile_table(segments, numel, torch.device("cuda"))
        for warps in (4, 8, 16):
            if tile // (32 * warps) < 4:  # fewer than four elements per thread
                continue
            ms = do_bench(lambda: adamw._adamw_tiles[(tiles.shape[0],)](
                tiles, grad, master, exp_avg, exp_avg_sq, out, coef, skip.view(torch.uint8), corrections,
                1e-4, 0.1, 0.9, 0.95, 1e-8, BLOCK=tile, num_warps=warps),
                warmup=5, rep=50)
            print(json.dumps({"kernel": "one-pass", "BLOCK": tile, "warps": warps, "ms": round(ms, 3),
                              "TB_s": round(30 * numel / ms / 1e9, 2)}), flush=True)
    params = [torch.nn.Parameter(master[lo:lo + n]) for lo, n, _ in segments]
    for p, (lo, n, _) in zip(params, segments):
        p.grad = grad[lo:lo + n]
    torch_adamw = torch.optim.AdamW(
        [{"params": [p for p, s in zip(params, segments) if s[2]], "weight_decay": 0.1},
         {"params": [p for p, s in zip(params, segments) if not s[2]], "weight_decay": 0.0}], lr=1e-4, fused=True)
    torch_adamw.grad_scale, torch_adamw.found_inf = coef, skip.float()
    ms = do_bench(torch_adamw.step, warmup=5, rep=50)
    print(json.dumps({"kernel": "torch fused AdamW", "ms": round(ms, 3), "TB_s": round(28 * numel / ms / 1e9, 2)}))
    ms = do_bench(lambda: out.copy_(master), warmup=5, rep=50)
    print(json.dumps({"kernel": "rounding copy", "ms": round(ms, 3), "TB_s": round(6 * numel / ms / 1e9, 2)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="time the kernel alone per tile size and warps")
    parser.add_argument("--host-profile", action="store_true", help="the host operations that took the most time")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sweep:
        sweep()
        return
    if args.child:
        print(json.dumps(measure(args.child, args.steps, args.host_profile)), flush=True)
        return
    for size in args.sizes:
        for kernels in ("1", "0"):
            extra = ["--host-profile"] if args.host_profile else []
            proc = subprocess.run([sys.executable, __file__, "--child", size, "--steps", str(args.steps), *extra],
                                  env=dict(os.environ, MEGAZERO_KERNELS=kernels), capture_output=True, text=True)
            lines = proc.stdout.strip().splitlines()
            print(lines[-1] if proc.returncode == 0 and lines else json.dumps(
                {"size": size, "kernels": kernels, "error": (proc.stdout + proc.stderr)[-1500:]}), flush=True)


if __name__ == "__main__":
    main()
