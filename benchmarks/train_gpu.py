"""Whole training steps of the megazero engine on GPUs: ZeRO stages, layouts, offload.

Run on one node (NCCL), e.g. the ZeRO comparison on two GPUs::

    torchrun --nproc_per_node 2 benchmarks/train_gpu.py configs/gpt_1.3b.yaml \\
        --runs stage0 stage1 stage2 stage3 stage3-offload

Each run builds the engine from the config plus the run's overrides (``stageN`` sets ``zero.stage``;
``-offload`` moves the optimizer to the CPU; ``tpN``/``ppN`` set the layout; ``bucketN`` the bucket
size in MiB; ``nooverlap`` reduces gradients after backward; ``sp`` turns on sequence parallelism
(``nosp`` off: with ``tp1``, for a config that sets it), whose linears communicate ``serial``,
``overlap`` or through peer memory (``pm``), or as ``parallel.tp_comm auto`` picks without one of
these; ``compile`` compiles blocks and head (``cg``: and replays the blocks as CUDA graphs, ``nocg``:
does not; without either, ``train.cuda_graphs`` null decides: graphs where the linears use peer
memory; the JSON line says what both became); ``zb`` and ``zb2`` pick the
zero-bubble schedules ZB-H1 and ZB-H2 (``izb``: interleaved with a split backward, with ``vN``;
``zbv``: ZB-V, two chunks a rank in a V, with ``v2``;
``wdefault``: their weight gradients at the default delays rather than those tuned to the stages'
op costs); ``vN`` N virtual stages a rank (interleaved 1F1B); ``splitA_B`` gives the
pipeline split [A, B] (else balanced by work); ``mN`` runs N micro-batches per data-parallel rank;
``mbsN`` sets the micro-batch size), trains ``--warmup`` then ``--steps`` timed optimizer steps on
random tokens, or an indexed shard's text with ``--text PREFIX`` (one micro-batch of
``train.micro_batch_size`` per data-parallel rank, like the peer baselines), and rank 0 prints one
JSON line: tokens/s per GPU, model TFLOP/s per GPU, MFU against the device's dense peak, peak memory
(rank 0's) and the model-state bytes the ZeRO formula predicts; a pipeline also its measured bubble
beside the theory and each pipeline rank's peak. The engine trains at the peers' learning rate
(``power_cap.PEER_OPTIMIZER``, before the command line's overrides, which win): it applies no
schedule, and on a power-capped GPU the clock depends on how the weights move. Rank 0 reports its
GPU's median SM clock and power over the timed steps, and with several ranks every rank's clock and
temperature. ``--cpu`` runs a tiny model on gloo to check the script.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import json
import os
import time
import warnings
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from data_pipeline.indexed import IndexedDataset
from data_pipeline.loader import to_batch
from megazero.config import load_config, resolve_config
from megazero.engine import Engine, pipeline_split
from megazero.flops import device_name, flops_per_token, peak_flops
from parallel.launch import destroy_process_group, init_process_group, pick_device, read_launch_env
from parallel.pipeline import bubble_fraction
from parallel.pipeline.plan import weight_grad_delays
from parallel.pipeline.schedule import SPLIT_BACKWARD
from parallel.topology import RankGrid, Topology
from power_cap import PEER_OPTIMIZER, ClockSampler, visible_gpu
from pp_gpu import measured_bubble
from trace_summary import span


def parse_run(run: str) -> tuple[list[str], Optional[int]]:
    """The config overrides a run's name asks for, and its micro-batches per data-parallel rank and
    step (``mN``; None: one, or 2*pp for a pipeline)."""
    out, micros = [], None
    for part in run.split("-"):
        if part.startswith("stage"):
            out += ["--zero.stage", part[5:]]
        elif part == "offload":
            out += ["--zero.offload_optimizer", "true"]
        elif part.startswith("tp"):
            out += ["--parallel.tp", part[2:]]
        elif part.startswith("pp"):
            out += ["--parallel.pp", part[2:]]
        elif part in ("sp", "nosp"):
            out += ["--parallel.sequence_parallel", str(part == "sp").lower()]
        elif part in ("serial", "overlap", "pm"):
            out += ["--parallel.tp_comm", {"pm": "peer_memory"}.get(part, part)]
        elif part in ("cg", "nocg"):
            out += ["--train.cuda_graphs", str(part == "cg").lower()]
        elif part == "compile":
            out += ["--train.compile", "true"]
        elif part in ("zb", "zb2", "izb", "zbv"):
            out += ["--parallel.pipeline_schedule",
                    {"zb": "zb-h1", "zb2": "zb-h2", "izb": "interleaved_zb", "zbv": "zb-v"}[part]]
        elif part.startswith("v") and part[1:].isdigit():
            out += ["--parallel.virtual_stages", part[1:]]
        elif part.startswith("mbs"):
            out += ["--train.micro_batch_size", part[3:]]
        elif part.startswith("m") and part[1:].isdigit():
            micros = int(part[1:])
        elif part == "nooverlap":
            out += ["--zero.overlap_comm", "false"]
        elif part.startswith("bucket"):
            out += ["--zero.bucket_size_mb", part[6:]]
        elif part.startswith("split"):
            out += ["--parallel.pipeline_split", "[" + part[5:].replace("_", ", ") + "]"]
        elif part == "wdefault":
            pass  # read by ``main``: not a config override
        else:
            raise SystemExit(f"unknown run part {part!r} in {run!r}")
    return out, micros


def profile_steps(engine, batch, out_dir: str, run_name: str, steps: int = 3) -> dict:
    """Profile ``steps`` more steps: rank 0 writes the kernel table to ``out_dir``, ranks 0 and 1 their
    timelines (``trace_RUN_rankR.json.gz``, for ``benchmarks/trace_summary.py`` or a trace viewer);
    returns how much of the wall time the GPU spent computing (kernels other than NCCL's, intervals
    merged)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.train_step(batch)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    busy = span([(e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA and "nccl" not in e.name.lower()])
    os.makedirs(out_dir, exist_ok=True)
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, f"profile_{run_name}.txt"), "w") as f:
            f.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=45))
    if dist.get_rank() < 2:
        prof.export_chrome_trace(os.path.join(out_dir, f"trace_{run_name}_rank{dist.get_rank()}.json.gz"))
    return {"profiled_step_ms": round(wall / steps * 1e3, 1), "compute_busy": round(busy / 1e6 / wall, 3)}


def host_syncs(engine, batch) -> list[str]:
    """Where one step makes the host wait for the GPU: the Python lines of its synchronizing CUDA
    calls, most frequent first (torch's sync debug mode reports each one as a warning; one made during
    backward is reported where autograd re-raises it, inside torch)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.train_step(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    places = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    return [f"{place} x{n}" for place, n in places.most_common()]


def pipeline_bubble(engine, batch, steps: int = 2) -> dict:
    """The pipeline's measured bubble (``pp_gpu.measured_bubble``) beside its theory, and how long each
    pipeline rank's ops ran in the last profiled step (ms): the rank with the most bounds the step,
    and what the others lack of it is what a better split could move (the split's cost model said 2%
    where GPT 1.3B's ranks measured 5% apart, BENCHMARKS.md)."""
    p = engine.cfg.parallel
    measured = measured_bubble(engine.executor, lambda: engine.train_step(batch), steps, engine.device)
    theory = bubble_fraction(p.pp, len(batch), p.virtual_stages, engine.executor.schedule)
    busy = by_pipeline_rank(engine.topo.pp_rank, p.pp, round(engine.executor.stats.compute_s * 1e3, 1))
    return {"bubble_measured": round(measured, 4), "bubble_theory": round(theory, 4), "busy_ms_by_pp_rank": busy}


def op_timeline(engine, batch) -> list[str]:
    """One profiled step's ops on every pipeline rank, as ``OP start+duration`` in ms from the first op
    of any rank (GPU events, placed on the host's wall clock: a gap between two ops is time the rank
    waited or its host fell behind, and the op it waited for shows on the other rank)."""
    executor = engine.executor
    executor.profile = True
    try:
        engine.train_step(batch)
    finally:
        executor.profile = False
    stats = executor.stats
    ops = [(f"{op.kind}{op.microbatch}{f'c{op.chunk}' if op.chunk else ''}", s, e)
           for op, (s, e) in zip(stats.ops, stats.op_times)]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (stats.first_op_at, f"rank {dist.get_rank()} (pp {engine.topo.pp_rank})", ops))
    origin = min(first for first, _, _ in every)
    return [f"{label}: " + " ".join(f"{name}:{(s + first - origin) * 1e3:.1f}+{(e - s) * 1e3:.1f}"
                                     for name, s, e in ops) for first, label, ops in every]


def clocks_by_rank(mine: dict) -> dict:
    """Every rank's median SM clock and temperature over the timed steps (``ClockSampler``), in rank
    order: a busy pipeline rank ran the same kernels 3% slower than its neighbour, which idled 4% of
    the step (BENCHMARKS.md), and one rank's sample cannot show such a difference."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"sm_MHz_by_rank": [c["sm_MHz"] for c in every], "temp_C_by_rank": [c["temp_C"] for c in every]}


def by_pipeline_rank(pp_rank: int, pp: int, value: float) -> list[float]:
    """``value`` of each pipeline rank, the largest over its tensor and data ranks (every rank calls)."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (pp_rank, value))
    most = [0.0] * pp
    for rank, v in every:
        most[rank] = max(most[rank], v)
    return most


def peaks_by_pipeline_rank(pp_rank: int, pp: int) -> list[float]:
    """Each pipeline rank's largest allocator peak over its tensor and data ranks, GiB: the ranks of
    a pipeline hold different blocks and micro-batches in flight, so rank 0's peak alone (``peak_GiB``)
    need not be the run's, which is what the planner's estimate is of."""
    return by_pipeline_rank(pp_rank, pp, round(torch.cuda.max_memory_allocated() / 2**30, 2))


def text_batch(prefix: str, micros: int, mbs: int, seq: int, vocab: int) -> list[dict]:
    """``micros`` micro-batches of consecutive text from the indexed shard ``prefix`` (documents joined
    in order; every data-parallel rank gets the same). Real text repeats some tokens far more than
    uniform random tokens do, which could slow the embedding's backward (a scatter-add into the
    rows of repeated tokens): this lets the engine alone run on the trainer's data to check."""
    data = IndexedDataset(prefix)
    need = micros * mbs * (seq + 1)
    if data.num_tokens < need:
        raise SystemExit(f"--text {prefix}: {data.num_tokens} tokens, {need} needed")
    flat, have = [], 0
    while have < need:
        flat.append(data[len(flat)])
        have += len(flat[-1])
    samples = np.concatenate(flat)[:need].reshape(micros, mbs, seq + 1)
    if int(samples.max()) >= vocab:
        raise SystemExit(f"--text {prefix}: token id {int(samples.max())} is outside the vocabulary of {vocab}")
    return [to_batch(list(micro)) for micro in samples]


def measure(cfg, launch, device, warmup: int, steps: int, profile_dir: str | None = None,
            run_name: str = "", sync_debug: bool = False, timeline: bool = False, text: str | None = None,
            default_delays: bool = False) -> dict:
    p = cfg.parallel
    topo = Topology(RankGrid(tp=p.tp, pp=p.pp, dp=p.dp, order=p.order), ranks_per_node=launch.local_world_size,
                    timeout_s=cfg.train.collective_timeout_s)
    t0 = time.perf_counter()
    engine = Engine(cfg, topo, device)
    if default_delays:
        engine.executor.op_costs = None
    build_s = time.perf_counter() - t0
    states_gib = torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else None
    mbs, seq = cfg.train.micro_batch_size, cfg.model.seq_length
    micros = cfg.train.global_batch_size // (mbs * p.dp)
    g = torch.Generator().manual_seed(topo.dp_rank)
    batch = text_batch(text, micros, mbs, seq, cfg.model.vocab_size) if text else [
        {"tokens": torch.randint(0, cfg.model.vocab_size, (mbs, seq), generator=g),
         "labels": torch.randint(0, cfg.model.vocab_size, (mbs, seq), generator=g)} for _ in range(micros)]
    for _ in range(warmup):
        out = engine.train_step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    sample = device.type == "cuda"  # every rank its own GPU: the ranks of a pipeline need not clock alike
    with ClockSampler(visible_gpu(launch.local_rank)) if sample else contextlib.nullcontext() as clock:
        t0 = time.perf_counter()
        norms = []
        for _ in range(steps):
            out = engine.train_step(batch)  # not read until the end: a loop that logs nothing never syncs
            norms.append(out.result.norm)
        loss = out.loss
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_s = (time.perf_counter() - t0) / steps
    tokens_per_gpu = cfg.train.global_batch_size * seq / step_s / dist.get_world_size()
    tflops = tokens_per_gpu * flops_per_token(cfg.model) / 1e12
    peak = peak_flops(device_name(device), cfg.precision.dtype)
    extra = profile_steps(engine, batch, profile_dir, run_name) if profile_dir and device.type == "cuda" else {}
    if cfg.parallel.pp > 1:
        extra.update(pipeline_bubble(engine, batch), pipeline_split=pipeline_split(cfg))
        ex = engine.executor
        if ex.schedule in SPLIT_BACKWARD and p.virtual_stages == 1:  # how many weight gradients each rank left waiting
            extra["wgrad_delays"] = (weight_grad_delays(ex.schedule, p.pp, len(batch), ex.op_costs)
                                     if ex.op_costs else tuple(range(p.pp)))
        if timeline:
            extra["op_timeline"] = op_timeline(engine, batch)
    if cfg.parallel.pp > 1 and device.type == "cuda":
        extra["peak_GiB_by_pp_rank"] = peaks_by_pipeline_rank(topo.pp_rank, p.pp)
    if sample and dist.get_world_size() > 1:
        extra.update(clocks_by_rank(clock.summary()))
    if sync_debug and device.type == "cuda":
        extra["host_syncs"] = host_syncs(engine, batch)
    predicted = engine.optimizer.predicted_memory()
    result = {
        "tokens_per_s_per_gpu": round(tokens_per_gpu), "tflops_per_gpu": round(tflops, 1),
        "mfu": round(tflops * 1e12 / peak, 3) if peak else None, "step_ms": round(step_s * 1e3, 1),
        "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
        # what the allocator holds, CUDA-graph pools included: replays use their memory without
        # allocating, so with train.cuda_graphs the peak above leaves it out
        "peak_reserved_GiB": round(torch.cuda.max_memory_reserved() / 2**30, 2) if device.type == "cuda" else None,
        "model_state_GiB_formula": round(predicted.total / 2**30, 2),
        "allocated_after_build_GiB": round(states_gib, 2) if states_gib is not None else None,
        "loss": round(loss, 4),
        # whether clipping acted on the timed steps: a schedule that updated before the global norm
        # was known (the zero-bubble paper's post-validation) would redo each step whose norm is above it
        "grad_norms": [round(float(n), 3) for n in norms], "clip_grad": cfg.optimizer.clip_grad,
        "tp_comm": engine.cfg.parallel.tp_comm, "cuda_graphs": engine.cfg.train.cuda_graphs,  # as resolved
        "build_s": round(build_s, 1),
        **(clock.summary() if clock is not None else {}),
        **extra,
    }
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--runs", nargs="+", default=["stage1"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cpu", action="store_true", help="tiny model on gloo, to check the script")
    ap.add_argument("--profile", metavar="DIR", help="also profile a few steps; kernel tables go to DIR")
    ap.add_argument("--sync-debug", action="store_true", help="also list where a step makes the host wait")
    ap.add_argument("--op-timeline", action="store_true", help="a pipeline also lists each rank's ops with times")
    ap.add_argument("--text", metavar="PREFIX", help="train on this indexed shard's text (e.g. the demo corpus, "
                    "data/demo/stdlib_text_document) instead of uniform random tokens")
    args, overrides = ap.parse_known_args()
    launch = read_launch_env()
    tiny = ["--train.device", "cpu", "--model.num_layers", "2", "--model.hidden_size", "64",
            "--model.num_heads", "4", "--model.seq_length", "64", "--model.vocab_size", "512",
            "--precision.dtype", "fp32"] if args.cpu else []
    base = [*PEER_OPTIMIZER, *tiny, *overrides]  # the command line's overrides win, --cpu's too
    cfg0 = load_config(args.config, base)
    device = pick_device(cfg0.train.device, launch.local_rank)
    init_process_group(launch, device, cfg0.train.collective_timeout_s)
    for run in args.runs:
        run_args, micros = parse_run(run)
        cfg = load_config(args.config, base + run_args)
        pp = cfg.parallel.pp
        dp = launch.world_size // (cfg.parallel.tp * pp)
        # without mN: one micro-batch per data-parallel rank, as the peer baselines run; a pipeline
        # gets 2*pp so its bubble is the usual (pp-1)/m rather than all of it
        micros = micros or (2 * pp if pp > 1 else 1)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(
            cfg.train, global_batch_size=cfg.train.micro_batch_size * dp * micros))
        cfg = resolve_config(cfg, launch.world_size, launch.local_world_size)
        result = measure(cfg, launch, device, args.warmup, args.steps, args.profile, run, args.sync_debug,
                         args.op_timeline, args.text, default_delays="wdefault" in run.split("-"))
        if launch.rank == 0:
            print(json.dumps({"run": run, "world": launch.world_size, "device": device_name(device) or "cpu",
                              "mbs": cfg.train.micro_batch_size, "global_batch": cfg.train.global_batch_size,
                              **result}), flush=True)
    destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
