"""Do training runs of other layouts follow a reference run's loss curve, and how fast did each go?

Each argument is a run directory written by ``megazero train`` (``scripts/pretrain_gpt.sh``): its
``metrics.jsonl`` (the per-step loss, throughput and memory) and ``config.yaml`` (the resolved
layout). The first is the reference, typically one GPU; every other run must report the same steps
with each step's loss within ``--tolerance`` (relative) of the reference's. Printed per run, as one
JSON line: the layout, the largest relative loss deviation and its step, and the medians, over the
steps after ``--skip``, of tokens/s per rank, TFLOP/s per device, MFU and peak memory. Exits 1 when
a run deviates or lacks steps::

    python benchmarks/loss_curves.py runs/ref runs/tp2-pp2-dp2 runs/dp8-zero3 --tolerance 0.02
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from megazero.config import load_config
from megazero.errors import UserError
from megazero.metrics import METRICS_FILE, read_metrics


def describe(run_dir: str) -> tuple[dict, dict[int, dict]]:
    """(the run's layout, its metrics rows by step)."""
    cfg = load_config(os.path.join(run_dir, "config.yaml"), [])
    p = cfg.parallel
    layout = {"tp": p.tp, "pp": p.pp, "dp": p.dp, "zero": cfg.zero.stage, "ranks": p.tp * p.pp * p.dp}
    rows = {row["step"]: row for row in read_metrics(os.path.join(run_dir, METRICS_FILE))}
    return layout, rows


def compare(reference: dict[int, dict], rows: dict[int, dict]) -> dict:
    """The largest relative loss deviation from ``reference`` over its steps, and the steps missing."""
    missing = sorted(set(reference) - set(rows))
    worst, at = 0.0, None
    for step in sorted(set(reference) & set(rows)):
        ref, got = reference[step]["loss"], rows[step]["loss"]
        deviation = abs(got - ref) / abs(ref) if ref else abs(got)
        if deviation > worst or at is None:
            worst, at = deviation, step
    return {"max_rel_loss_deviation": float(f"{worst:.3g}"), "at_step": at, "missing_steps": missing}


def speed(rows: dict[int, dict], ranks: int, skip: int) -> dict:
    """Medians over the steps after the first ``skip`` (compilation, warm-up)."""
    kept = [rows[s] for s in sorted(rows)[skip:]]
    if not kept:
        return {}

    def median(key: str, scale: float = 1.0):
        values = [r[key] * scale for r in kept if r.get(key) is not None]
        return round(statistics.median(values), 3) if values else None
    return {"tokens_per_s_per_rank": median("tokens_per_s", 1 / ranks), "tflops_per_device": median("tflops_per_device"),
            "mfu": median("mfu"), "mem_peak_gib": median("mem_peak_gib"),
            "mem_reserved_peak_gib": median("mem_reserved_peak_gib")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories, the reference first")
    ap.add_argument("--tolerance", type=float, default=0.02, help="largest relative loss deviation allowed")
    ap.add_argument("--skip", type=int, default=5, help="steps left out of the speed medians")
    args = ap.parse_args()
    ok = True
    reference = None
    for run in args.runs:
        try:
            layout, rows = describe(run)
        except (OSError, UserError) as exc:
            print(f"loss_curves: {run}: {exc}", file=sys.stderr)
            return 2
        if reference is None:
            reference = rows
            if not rows:
                print(f"loss_curves: {run}: the reference run has no steps", file=sys.stderr)
                return 2
            verdict = {"reference": True}
        else:
            verdict = compare(reference, rows)
            verdict["within_tolerance"] = verdict["max_rel_loss_deviation"] <= args.tolerance and not verdict["missing_steps"]
            ok &= verdict["within_tolerance"]
        print(json.dumps({"run": run, **layout, "steps": len(rows), **verdict, **speed(rows, layout["ranks"], args.skip)}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
