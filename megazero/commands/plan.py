"""`megazero plan CONFIG --gpus N --gpus-per-node G`: rank the tp x pp x dp layouts, ZeRO stages,
micro-batch sizes and recompute modes a config could train with, by predicted memory and speed."""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import sys

from megazero.commands.generate import at_least
from megazero.errors import UserError

# The presets' peaks and efficiencies are for 16-bit tensor-core math (planner/hardware.py); memory is
# counted in the config's own dtype.
FP32_NOTE = ("note: precision.dtype is fp32, but step times and speeds assume bf16/fp16 tensor-core math "
             "(the GPU's 16-bit peak); an fp32 run will be slower (its memory is counted as fp32)")
NUMBERS = ("memory_gib", "needed_gib", "step_s", "tokens_per_s", "tflops_per_gpu", "mfu")


MIN_HARDWARE_FIGURE = 1e-3
"""The least GiB, TFLOP/s or GB/s a hardware flag takes: a figure near float's smallest divides
step times into inf and NaN (a plan of 0 tokens/s, or a traceback)."""


def register(subparsers) -> None:
    from megazero.planner import GPUS

    parser = subparsers.add_parser(
        "plan", usage="megazero plan CONFIG --gpus N --gpus-per-node G [--gpu NAME] [--section.field VALUE ...]",
        help="Rank the tp x pp x dp layouts and ZeRO stages for a model on a cluster, before booking it",
        description="Enumerate the layouts (tp, pp, dp, virtual stages, ZeRO stage, micro-batch, recompute, "
                    "sequence parallel) that megazero train accepts for CONFIG on the cluster, predict each "
                    "one's memory per GPU and step time, and print the fastest that fit. Dotted overrides "
                    "(--train.global_batch_size 1024) change the config first; those of a searched field "
                    "(--zero.stage 3, --parallel.tp 2, ...) hold it at that value. The formulas and their "
                    "sources are in docs/planner.md.")
    parser.add_argument("--gpus", type=at_least(1), required=True, help="GPUs in the cluster")
    parser.add_argument("--gpus-per-node", type=at_least(1), required=True, help="GPUs per node")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="GPU preset (default h100)")
    parser.add_argument("--gpu-memory", type=float, metavar="GiB", help="Device memory, replacing the preset's")
    parser.add_argument("--peak-tflops", type=float, help="Dense 16-bit peak TFLOP/s, replacing the preset's")
    parser.add_argument("--intra-node-GBps", type=float, help="NVLink GB/s per GPU, one direction")
    parser.add_argument("--inter-node-GBps", type=float, help="InfiniBand GB/s per GPU (the node's NICs / its GPUs)")
    parser.add_argument("--top", type=at_least(1), default=10, help="Layouts to show (default 10)")
    parser.add_argument("--json", action="store_true", help="Print the ranked layouts as one JSON object")
    parser.set_defaults(func=run, accepts_overrides=True)


def run(args) -> int:
    from megazero.commands.train import split_config_path
    from megazero.config import load_config, validate_config
    from megazero.config.loader import parse_overrides
    from megazero.config.schema import Config
    from megazero.config.validate import validate_without_layout
    from megazero.planner import GPUS, Cluster, custom_gpu, plan
    from megazero.planner.fit import STATED, budget_problem, none_fits_advice
    from megazero.planner.search import KNOBS, held_knobs, usable_world

    if args.gpus % args.gpus_per_node and args.gpus > args.gpus_per_node:
        raise UserError(f"--gpus {args.gpus} is not a whole number of nodes of --gpus-per-node {args.gpus_per_node}")
    for flag in ("gpu_memory", "peak_tflops", "intra_node_GBps", "inter_node_GBps"):
        value = getattr(args, flag)
        if value is not None and not (MIN_HARDWARE_FIGURE <= value and math.isfinite(value)):
            raise UserError(f"--{flag.replace('_', '-')}: must be a finite number of at least {MIN_HARDWARE_FIGURE}, "
                            f"got {value}")
    config_path, overrides = split_config_path(args.overrides)
    if config_path is None:
        raise UserError("give the CONFIG to plan for, e.g. megazero plan configs/gpt_1.3b.yaml --gpus 8 --gpus-per-node 8")
    cfg = load_config(config_path, overrides)
    validate_without_layout(cfg)  # the config's own values; each layout is validated whole for the world below
    gpu = custom_gpu(GPUS[args.gpu], args.gpu_memory, args.peak_tflops, args.intra_node_GBps, args.inter_node_GBps)
    budget = cfg.train.memory_budget_gib
    if budget is not None:  # the run's own cap on a rank's memory, which its start-up check holds it to
        source = "given by --gpu-memory" if args.gpu_memory is not None else f"of the {gpu.name} (--gpu {args.gpu})"
        problem = budget_problem(budget, gpu.memory_gib, source)
        if problem:
            raise UserError(problem)
        gpu = custom_gpu(gpu, memory_gib=budget)
    cluster = Cluster(gpu, args.gpus, min(args.gpus_per_node, args.gpus))
    # the knobs the command line holds, named as the config spells them (load_config refused any other spelling)
    fixed = frozenset(key for key, _ in parse_overrides(overrides, Config)) & set(KNOBS)
    ranked = plan(cfg, cluster, fixed)
    if not ranked:
        usable = 0 if fixed else usable_world(cfg, cluster)
        if usable:
            raise UserError(f"no layout of {config_path} is valid on {args.gpus} GPUs: they do not split as tp (a power "
                            f"of two dividing the {cluster.gpus_per_node} GPUs of a node, the model's head counts and MLP "
                            f"width) x pp (up to "
                            f"model.num_layers {cfg.model.num_layers}) x dp (dividing train.global_batch_size "
                            f"{cfg.train.global_batch_size}); plan for {usable} GPUs, or raise train.global_batch_size")
        validate_config(cfg)  # what is wrong with the config's own layout (a held tp 3 with 16 heads), if anything
        held = f" with {', '.join(sorted(fixed))} as given" if fixed else ""
        raise UserError(f"no layout of {config_path} is valid on {args.gpus} GPUs{held}: run megazero train --check "
                        f"with WORLD_SIZE={args.gpus} LOCAL_WORLD_SIZE={cluster.gpus_per_node} and a layout to see why")
    rows = [row(c) for c in ranked[:args.top]]
    fitting = sum(c.fits for c in ranked)
    note = FP32_NOTE if cfg.precision.dtype == "fp32" else None
    if args.json:
        if note:
            print(note, file=sys.stderr)  # stdout is the JSON object alone
        print(json.dumps({"gpu": dataclasses.asdict(gpu), "gpus": cluster.num_gpus, "gpus_per_node": cluster.gpus_per_node,
                          "valid_layouts": len(ranked), "fitting_layouts": fitting, "layouts": rows}, indent=1))
        return 0
    m, t = cfg.model, cfg.train
    print(f"{config_path}: {m.num_layers} layers x hidden {m.hidden_size}, global batch {t.global_batch_size} x "
          f"{m.seq_length} tokens on {cluster.num_gpus} x {gpu.name} ({cluster.nodes} node(s) of "
          f"{cluster.gpus_per_node}, {gpu.memory_gib:g} GiB each{f' by {STATED}' if budget is not None else ''}); "
          f"{len(ranked)} valid layouts, {fitting} fit")
    print(format_table(rows))
    if fitting:  # the first row, fastest of those that fit, as the launch that trains it
        print(f"to train the first: CONFIG={shlex.quote(config_path)} scripts/pretrain_gpt.sh "
              f"{shlex.join(overrides)}{' ' if overrides else ''}{rows[0]['overrides']}")
    else:
        held = held_knobs(cfg, fixed)
        print(f"none fits: {none_fits_advice(cfg, held)}")
    if note:
        print(note)
    return 0


def row(candidate) -> dict:
    layout, memory, step = candidate.layout, candidate.memory, candidate.step
    return {**dataclasses.asdict(layout), "fits": candidate.fits,
            "memory_gib": round(memory.peak / 2**30, 2), "needed_gib": round(memory.needed / 2**30, 2),
            "step_s": float(f"{step.step_s:.4g}"),  # significant digits: a small model's step is under 0.1 ms
            "tokens_per_s": round(step.tokens_per_s),
            "tflops_per_gpu": round(step.tflops_per_gpu, 1), "mfu": round(step.mfu, 3),
            "overrides": " ".join(layout.overrides())}


COLUMNS = [("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("v", "virtual_stages"), ("zero", "zero_stage"),
           ("mbs", "micro_batch_size"), ("recompute", "recompute"), ("sp", "sequence_parallel"),
           ("schedule", "schedule"), ("GiB/GPU", "memory_gib"), ("fits", "fits"), ("step s", "step_s"), ("tokens/s", "tokens_per_s"),
           ("TFLOP/s/GPU", "tflops_per_gpu"), ("MFU", "mfu")]


def format_table(rows: list[dict]) -> str:
    def cell(key, value):
        if isinstance(value, bool):
            return "yes" if value else "no"
        if key == "tokens_per_s":
            return f"{value:,}"
        if key == "step_s":
            return f"{value:.3g}"
        return str(value)

    cells = [[name for name, _ in COLUMNS]] + [[cell(key, r[key]) for _, key in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(text.rjust(w) for text, w in zip(line, widths)) for line in cells)
