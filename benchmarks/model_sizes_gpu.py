"""megazero through the user's path against plain PyTorch + torch.compile, on one GPU, per model size.

    python benchmarks/model_sizes_gpu.py --sizes 125m 350m 1.3b llama-1.3b --runs megazero torch plain

Each run is its own process, so each peak memory is its own. ``NPROC_PER_NODE`` (1 unless set) ranks
run megazero, for a layout that ``--megazero-args`` sets (``--parallel.tp 2``, say); its tokens/s are
the whole job's:

* ``megazero``: ``scripts/pretrain_gpt.sh`` (torchrun, the trainer, demo data) on
  ``configs/gpt_1.3b.yaml`` resized, ZeRO stage 0, compiled, with the fused kernels (the default);
* ``torch``: the same with ``MEGAZERO_KERNELS=0``: every op is its torch reference, so the
  difference between the two is what the kernels bring;
* ``plain``: the peer baseline ``benchmarks/peers/single_gpu.py`` (nanoGPT-style GPT of the same
  shape, bf16 autocast, fused AdamW, ``torch.compile``), for the GPT-2 sizes (it has no Llama).

Every megazero run trains with the peer's optimizer settings (``power_cap.PEER_OPTIMIZER``: learning
rate 1e-4, constant) rather than the config's 2000-step warm-up: the GPU sits on its power cap, its
clock follows the energy a step costs, and near-initial weights cost more (with the config's warm-up
the same trainer ran 1.6% slower at a 2.4% lower clock). Each line gives the run's median SM clock
and board power while the GPU was busy (its warm-up steps too), so that a comparison made at
different clocks shows.

Throughput is the median tokens/s of the steps after ``--skip`` (compilation and allocator warm-up),
``host_wait_ms`` the median time the trainer's host waited for a step's results (near 0: the host,
not the GPU, bounds the run, unless a step has more kernels than the launch queue holds, as at 1.3B,
where the host blocks launching instead and the figure is near 0 either way);
MFU counts 6N + 12·layers·hidden·seq FLOPs per token against 989 TFLOP/s for every run, so the
columns compare; peak memory is the most allocated at any point of the run. Prints one JSON line
per run and a table at the end. Builds the demo corpus into ``data/demo`` first if it is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

from power_cap import PEER_OPTIMIZER, ClockSampler

SIZES = {  # name: (layers, hidden, heads, preset, micro-batch)
    "125m": (12, 768, 12, "gpt2", 16), "350m": (24, 1024, 16, "gpt2", 8), "1.3b": (24, 2048, 16, "gpt2", 8),
    "llama-1.3b": (24, 2048, 16, "llama", 8),
}
SEQ, VOCAB, PEAK_TFLOPS = 2048, 50257, 989.0
DATA = "data/demo/stdlib_text_document"


def flops_per_token(layers: int, hidden: int, preset: str) -> float:
    """6N + 12·L·h·s with N the parameters (a tied head counted once), as the peers count."""
    padded = -(-VOCAB // 128) * 128
    if preset == "llama":
        ffn = -(-(8 * hidden // 3) // 64) * 64
        block = 4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden
        params = 2 * padded * hidden + layers * block + hidden
    else:
        block = 12 * hidden * hidden + 13 * hidden
        params = padded * hidden + SEQ * hidden + layers * block + 2 * hidden
    return 6 * params + 12 * layers * hidden * SEQ


def megazero(size: str, kernels: bool, steps: int, skip: int, timeout: int, extra: list[str]) -> dict:
    layers, hidden, heads, preset, mbs = SIZES[size]
    run_dir = tempfile.mkdtemp(prefix=f"mz-{size}-")
    overrides = ["--model.preset", preset, "--model.num_layers", str(layers), "--model.hidden_size", str(hidden),
                 "--model.num_heads", str(heads), "--zero.stage", "0", "--train.compile", "true",
                 "--train.micro_batch_size", str(mbs), "--train.global_batch_size", str(mbs),
                 "--train.train_steps", str(steps), "--logging.log_interval", str(steps),
                 "--checkpoint.save_on_exit", "false", "--logging.run_dir", run_dir,
                 "--data.blend", f"[[1.0, {DATA}]]", *PEER_OPTIMIZER, *extra]
    env = dict(os.environ, CONFIG="configs/gpt_1.3b.yaml", NPROC_PER_NODE=os.environ.get("NPROC_PER_NODE", "1"),
               MEGAZERO_KERNELS="1" if kernels else "0")
    proc = subprocess.run(["bash", "scripts/pretrain_gpt.sh", *overrides], env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-1500:]}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "tokens_per_s" in r]
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in rows[skip:])
    waits = [r["host_wait_s"] for r in rows[skip:] if r.get("host_wait_s") is not None]
    return {"tokens_per_s": round(tokens_per_s), "peak_GiB": round(max(r.get("mem_peak_gib", 0.0) for r in rows), 2),
            "host_wait_ms": round(1e3 * statistics.median(waits), 2) if waits else None,
            "reserved_GiB": round(max(r.get("mem_reserved_peak_gib", 0.0) for r in rows), 2),
            "loss": round(rows[-1]["loss"], 3)}


def plain(size: str, steps: int, skip: int, timeout: int) -> dict:
    mbs = SIZES[size][4]
    code = ("import json, sys; sys.path.insert(0, 'benchmarks/peers'); from single_gpu import measure; "
            f"print(measure({size!r}, {mbs}, {SEQ}, True, {skip}, {steps - skip}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-1500:]}
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"tokens_per_s": line["tokens_per_s_per_gpu"], "peak_GiB": line["peak_GiB"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--runs", nargs="+", default=["megazero", "torch", "plain"],
                        choices=["megazero", "torch", "plain"])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--skip", type=int, default=8, help="steps left out of the median (warm-up)")
    parser.add_argument("--timeout", type=int, default=240, help="seconds for one run")
    parser.add_argument("--megazero-args", default="", help="more config overrides for the megazero and torch "
                        "runs, after PEER_OPTIMIZER's (so they win), e.g. '--train.cuda_graphs true'")
    args = parser.parse_args()
    if "megazero" in args.runs or "torch" in args.runs:
        if not os.path.exists(DATA + ".idx"):
            subprocess.run([sys.executable, "-m", "megazero.cli", "demo-corpus", "data/demo"], check=True,
                           capture_output=True)
    table, extra = [], shlex.split(args.megazero_args)
    for size in args.sizes:
        layers, hidden, _, preset, mbs = SIZES[size]
        for run in args.runs:
            if run == "plain" and preset != "gpt2":
                continue
            try:
                with ClockSampler() as clock:
                    result = (plain(size, args.steps, args.skip, args.timeout) if run == "plain" else
                              megazero(size, run == "megazero", args.steps, args.skip, args.timeout, extra))
                result.update(clock.summary())
            except subprocess.TimeoutExpired:
                result = {"error": f"timed out after {args.timeout}s"}
            if "tokens_per_s" in result:
                mfu = result["tokens_per_s"] * flops_per_token(layers, hidden, preset) / (PEAK_TFLOPS * 1e12)
                result["mfu"] = round(mfu, 3)
            line = {"size": size, "run": run, "micro_batch": mbs, **result}
            print(json.dumps(line), flush=True)
            table.append(line)
    print(f"\n{'size':11s} {'run':9s} {'tokens/s':>10s} {'MFU':>6s} {'peak GiB':>9s} {'SM MHz':>7s} {'W':>5s}  vs plain")
    for line in table:
        if "tokens_per_s" not in line:
            print(f"{line['size']:11s} {line['run']:9s} failed")
            continue
        base = next((b for b in table if b["size"] == line["size"] and b["run"] == "plain" and "tokens_per_s" in b),
                    None)
        ratio = f"{line['tokens_per_s'] / base['tokens_per_s']:.3f}x" if base else "-"
        print(f"{line['size']:11s} {line['run']:9s} {line['tokens_per_s']:>10,d} {100 * line['mfu']:5.1f}% "
              f"{line['peak_GiB']:>9.2f} {line['sm_MHz'] or 0:>7.0f} {line['power_W'] or 0:>5.0f}  {ratio}")


if __name__ == "__main__":
    main()
