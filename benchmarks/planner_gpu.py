"""The planner's predictions beside what `megazero train` measures, for the GPT 1.3B on one node.

On a GPU machine, from the repository root (the demo shard is built once if missing)::

    python benchmarks/planner_gpu.py                      # all five runs
    python benchmarks/planner_gpu.py --runs 1gpu 2gpu-zero3 --steps 40

Each run is a real `megazero train configs/gpt_1.3b.yaml` under the project's launcher
(``python -m parallel.launch``, torchrun) on the demo corpus, global batch 32 of micro-batch 8, for
``--steps`` steps. From its ``metrics.jsonl`` it takes the median tokens/s over the steps after
``--skip`` (compilation and warm-up) and rank 0's peak allocated memory, and prints one JSON line
with the planner's predicted tokens/s and peak memory for the same config, layout and GPU (preset
chosen by the device's name), and the ratios. Runs: ``1gpu`` (ZeRO 1), ``2gpu-zero1``,
``2gpu-zero3``, ``2gpu-pp2``, ``2gpu-tp2`` (sequence parallel on), and ``2gpu-tp2-mbs4`` (the same at
micro-batch 4: a check of the tensor-parallel constant, which was fitted on ``2gpu-tp2``). The efficiency constants in
``megazero/planner/hardware.py`` can be checked on the ``1gpu`` run: measured tokens/s over predicted,
times the preset's efficiency (which scales the micro-batch's fixed cost with it: the H100/H200
figures were fitted together with that cost, from ``benchmarks/train_gpu.py`` runs of one step's
sequences in micro-batches of 1 to 16, ``compile-m16-mbs1`` ... ``compile-m1-mbs16``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

from megazero.config import load_config, resolve_config
from megazero.planner import GPUS, Cluster, evaluate

CONFIG = "configs/gpt_1.3b.yaml"
DATA = "data/demo/stdlib_text_document"
RUNS = {
    "1gpu": (1, []),
    "2gpu-zero1": (2, ["--zero.stage", "1"]),
    "2gpu-zero3": (2, ["--zero.stage", "3"]),
    "2gpu-pp2": (2, ["--parallel.pp", "2"]),
    "2gpu-tp2": (2, ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"]),
    "2gpu-tp2-mbs4": (2, ["--parallel.tp", "2", "--parallel.sequence_parallel", "true",
                          "--train.micro_batch_size", "4"]),
}


def gpu_preset() -> str:
    name = torch.cuda.get_device_name(0).upper()
    return next((k for k in GPUS if k.split("-")[0].upper() in name), "h100")


def train(gpus: int, overrides: list[str], run_dir: str) -> list[dict]:
    cmd = [sys.executable, "-m", "parallel.launch", "--standalone", "--nproc_per_node", str(gpus),
           "-m", "megazero.cli", "train", CONFIG, *overrides, "--logging.run_dir", run_dir]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if "tokens_per_s" in row]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=list(RUNS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=10, help="first steps left out of the median (compile, warm-up)")
    args = ap.parse_args()
    if not os.path.exists(DATA + ".idx"):
        subprocess.run([sys.executable, "-m", "megazero.cli", "demo-corpus", "data/demo"], check=True)
    preset = gpu_preset()
    available = torch.cuda.device_count()
    for name in args.runs:
        gpus, layout = RUNS[name]
        if gpus > available:
            print(json.dumps({"run": name, "skipped": f"needs {gpus} GPUs, {available} visible"}), flush=True)
            continue
        overrides = [*layout, "--data.blend", f"[[1.0, {DATA}]]",
                     "--train.global_batch_size", "32", "--train.train_steps", str(args.steps),
                     "--logging.log_interval", "1", "--checkpoint.save_on_exit", "false", "--train.device", "cuda"]
        cfg = resolve_config(load_config(CONFIG, overrides), gpus, gpus)
        predicted = evaluate(cfg, Cluster(GPUS[preset], gpus, gpus))
        with tempfile.TemporaryDirectory() as run_dir:
            rows = train(gpus, overrides, run_dir)
        timed = [r for r in rows if r["step"] > args.skip] or rows
        tokens_per_s = statistics.median(r["tokens_per_s"] for r in timed)
        peak = max(r.get("mem_peak_gib") or 0.0 for r in rows)
        print(json.dumps({
            "run": name, "gpus": gpus, "device": torch.cuda.get_device_name(0), "preset": preset,
            "measured_tokens_per_s": round(tokens_per_s), "predicted_tokens_per_s": round(predicted.step.tokens_per_s),
            "tokens_ratio": round(predicted.step.tokens_per_s / tokens_per_s, 3),
            "measured_peak_gib": round(peak, 2), "predicted_peak_gib": round(predicted.memory.peak / 2**30, 2),
            "memory_ratio": round(predicted.memory.peak / 2**30 / peak, 3) if peak else None,
            "calibrated_efficiency": round(GPUS[preset].efficiency * tokens_per_s / predicted.step.tokens_per_s, 3),
        }), flush=True)


if __name__ == "__main__":
    main()
