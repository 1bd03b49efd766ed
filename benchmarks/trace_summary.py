"""What a profiled step's timeline says about where its wall time went, from a torch profiler trace.

``benchmarks/train_gpu.py --profile DIR`` writes ``trace_RUN_rankR.json.gz``; this reads one and prints:
the GPU's time per stream, computing, copying, in NCCL and with nothing running; GPU time by kind
of kernel (GEMMs, attention, inductor's Triton, NCCL, ...) and the longest kernels; each kind of
collective's count, time and the part of it no compute kernel ran beside (exposed); the longest idle
gaps with the host operation that launched the work ending each (what the GPU was waiting for); the
CUDA runtime calls that took the host longest (a synchronizing call shows up here); and, for the two
busiest host threads (the Python thread and autograd's backward thread), the operations with the
most self time::

    python benchmarks/trace_summary.py DIR/trace_tp2-sp-compile_rank0.json.gz

A trainer's trace (``logging.profile_steps``) also says how many steps it holds and how long the host
took to queue each, through its ``megazero step N`` ranges.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
from typing import Optional

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function")
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def span(intervals: list[tuple[float, float]]) -> float:
    return sum(hi - lo for lo, hi in merged(intervals))


def interval(e: dict) -> tuple[float, float]:
    return e["ts"], e["ts"] + e["dur"]


def stream_of(e: dict):
    return e.get("args", {}).get("stream", e.get("tid"))


class HostThread:
    """One host thread's operations, sorted so that a parent comes before the children it encloses."""

    def __init__(self, ops: list[dict]):
        self.ops = sorted(ops, key=lambda e: (e["ts"], -e["dur"]))
        self.starts = [e["ts"] for e in self.ops]
        self.longest = max((e["dur"] for e in self.ops), default=0.0)

    def innermost(self, t: float) -> str:
        """The shortest operation running at time ``t``."""
        best = None
        for e in self.ops[bisect.bisect_left(self.starts, t - self.longest):bisect.bisect_right(self.starts, t)]:
            if e["ts"] <= t <= e["ts"] + e["dur"] and (best is None or e["dur"] < best["dur"]):
                best = e
        return best["name"][:90] if best else "(no host op)"

    def self_times(self) -> dict[str, float]:
        """Each operation name's duration less its direct children's, summed."""
        out: dict[str, float] = collections.defaultdict(float)
        stack: list[dict] = []
        for e in self.ops:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                out[stack[-1]["name"]] -= e["dur"]
            out[e["name"]] += e["dur"]
            stack.append(e)
        return out


def covered(intervals: list[tuple[float, float]], starts: list[float], lo: float, hi: float) -> float:
    """How much of [lo, hi] the merged, sorted ``intervals`` (``starts``: their starts) cover."""
    total, i = 0.0, max(0, bisect.bisect_right(starts, lo) - 1)
    while i < len(intervals) and intervals[i][0] < hi:
        a, b = intervals[i]
        total += max(0.0, min(b, hi) - max(a, lo))
        i += 1
    return total


def is_nccl(e: dict) -> bool:
    return e["cat"] == "kernel" and "nccl" in e["name"].lower()


def compute_intervals(gpu: list[dict]) -> list[tuple[float, float]]:
    """When any kernel other than NCCL's ran, merged."""
    return merged([interval(e) for e in gpu if e["cat"] == "kernel" and not is_nccl(e)])


def collective_table(gpu: list[dict], compute: list[tuple[float, float]]) -> dict[str, list[float]]:
    """Per NCCL kernel kind: [count, total time, time no ``compute`` interval ran beside it (exposed)]."""
    starts = [lo for lo, _ in compute]
    table: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for e in gpu:
        if is_nccl(e):
            row = table[e["name"].split("(")[0].replace("ncclDevKernel_", "")]
            lo, hi = interval(e)
            row[0] += 1
            row[1] += e["dur"]
            row[2] += e["dur"] - covered(compute, starts, lo, hi)
    return table


KERNEL_KINDS = (  # (kind, name fragments), the first match wins
    ("NCCL", ("nccl",)), ("GEMMs", ("gemm", "cutlass", "xmma", "nvjet", "gemv")),
    ("attention", ("flash", "fmha", "cudnn", "attention")), ("inductor Triton", ("triton_",)),
    ("torch reductions", ("reduce_kernel",)), ("torch foreach", ("multi_tensor_apply", "foreach")),
    ("torch elementwise", ("elementwise_kernel",)))


def kernel_kind(e: dict) -> str:
    if e["cat"] != "kernel":
        return "copies and memsets"
    name = e["name"].lower()
    return next((kind for kind, parts in KERNEL_KINDS if any(p in name for p in parts)), "other")


def kind_table(gpu: list[dict], steps: int, top: int) -> None:
    """GPU time per step by kind of kernel, then the kernels that took longest (per step)."""
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    names: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in gpu:
        for row in (kinds[kernel_kind(e)], names[e["name"]]):
            row[0] += 1
            row[1] += e["dur"]
    total = sum(t for _, t in kinds.values())
    print(f"  GPU time per step by kind (of {steps} step(s); ms, launches): all {total / steps / 1e3:.1f}")
    for kind, (n, t) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        print(f"    {t / steps / 1e3:8.2f} {n / steps:8.1f}  {kind}")
    print("  longest kernels per step (ms, launches):")
    for name, (n, t) in sorted(names.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"    {t / steps / 1e3:8.2f} {n / steps:8.1f}  {name[:100]}")


def step_ranges(events: list[dict]) -> dict[int, float]:
    """The trainer's ``megazero step N`` host ranges (``logging.profile_steps``): step -> microseconds the
    host took to queue it (its batch, forward, backward and update launches)."""
    out = {}
    for e in events:
        name = str(e.get("name"))
        if e.get("cat") == "user_annotation" and name.startswith("megazero step "):
            out[int(name.rsplit(" ", 1)[1])] = e["dur"]
    return out


def summarize(events: list[dict], top: int, steps: Optional[int] = None) -> None:
    """Print where a trace's wall time went; the kind table is per step, over ``steps`` steps (by
    default the trainer's step ranges in the trace, else 1)."""
    ranges = step_ranges(events)
    if ranges:
        print("host time to queue each step (ms): "
              + ", ".join(f"step {n} {t / 1e3:.1f}" for n, t in sorted(ranges.items())))
    steps = steps or len(ranges) or 1
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    if not gpu:
        raise SystemExit("no GPU events in this trace")
    lo = min(e["ts"] for e in gpu)
    wall = max(e["ts"] + e["dur"] for e in gpu) - lo
    if wall <= 0:
        raise SystemExit("the GPU events in this trace span no time")
    print(f"GPU window {wall / 1e3:.1f} ms")
    streams = collections.defaultdict(list)
    for e in gpu:
        streams[stream_of(e)].append(e)
    busy_of = {stream: span([interval(e) for e in evs]) for stream, evs in streams.items()}
    for stream, evs in sorted(streams.items(), key=lambda kv: -busy_of[kv[0]]):
        busy = busy_of[stream]
        common = collections.Counter(e["name"][:40] for e in evs).most_common(1)[0][0]
        print(f"  stream {stream}: busy {busy / 1e3:8.1f} ms ({busy / wall:5.1%}), {len(evs)} ops, most {common!r}")
    nccl = [interval(e) for e in gpu if is_nccl(e)]
    compute = compute_intervals(gpu)
    copies = [interval(e) for e in gpu if e["cat"] != "kernel"]
    busy = merged([interval(e) for e in gpu])
    print(f"  compute kernels (not NCCL) {span(compute) / 1e3:.1f} ms ({span(compute) / wall:.1%}), "
          f"NCCL {span(nccl) / 1e3:.1f} ms, copies and memsets {span(copies) / 1e3:.1f} ms, "
          f"nothing running {(wall - span(busy)) / 1e3:.1f} ms")

    kind_table(gpu, steps, top)
    table = collective_table(gpu, compute)
    if table:
        print("  collectives (count, total ms, ms with no compute kernel beside them):")
        for name, (n, total, exposed) in sorted(table.items(), key=lambda kv: -kv[1][1]):
            print(f"    {n:6d} {total / 1e3:8.2f} {exposed / 1e3:8.2f}  {name}")

    host = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in HOST_CATEGORIES:
            host[e["tid"]].append(e)
    threads = {tid: HostThread(ops) for tid, ops in host.items()}
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in RUNTIME_CATEGORIES and "correlation" in e.get("args", {})}
    ends = sorted(gpu, key=lambda e: e["ts"])
    starts = [e["ts"] for e in ends]
    gaps = sorted(((b_lo - a_hi, a_hi, b_lo) for (_, a_hi), (b_lo, _) in zip(busy, busy[1:])), reverse=True)
    short = [g for g, _, _ in gaps if g < 500]
    print(f"  {len(gaps)} idle gaps, {sum(g for g, _, _ in gaps) / 1e3:.1f} ms ({len(short)} under 0.5 ms: "
          f"{sum(short) / 1e3:.1f} ms, the launch gaps between kernels); longest, with the host op that "
          "launched the work ending each:")
    for gap, begin, end in gaps[:top]:
        first = ends[bisect.bisect_left(starts, end)]
        launch = launches.get(first.get("args", {}).get("correlation"))
        where = threads[launch["tid"]].innermost(launch["ts"]) if launch and launch["tid"] in threads else "(unknown)"
        print(f"    {gap / 1e3:7.2f} ms at +{(begin - lo) / 1e3:8.1f}  {where}")

    runtime = collections.defaultdict(lambda: [0.0, 0, 0.0])
    for e in events:
        if e.get("cat") in RUNTIME_CATEGORIES:
            r = runtime[e["name"]]
            r[0] += e["dur"]
            r[1] += 1
            r[2] = max(r[2], e["dur"])
    print("CUDA runtime calls by host time (total ms, calls, longest ms):")
    for name, (total, n, longest) in sorted(runtime.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {total / 1e3:8.2f} {n:6d} {longest / 1e3:8.2f}  {name}")

    for tid, thread in sorted(threads.items(), key=lambda kv: -len(kv[1].ops))[:2]:
        first, last = thread.ops[0]["ts"], max(e["ts"] + e["dur"] for e in thread.ops)
        print(f"host thread {tid}: {len(thread.ops)} ops over {(last - first) / 1e3:.1f} ms; most self time (ms):")
        for name, t in sorted(thread.self_times().items(), key=lambda kv: -kv[1])[:top]:
            print(f"  {t / 1e3:8.2f}  {name[:100]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--steps", type=int, help="steps the trace holds (train_gpu.py profiles 3; a trainer's "
                    "trace says, through its step ranges): the kind table is per step")
    args = ap.parse_args()
    for path in args.traces:
        print(f"== {path}")
        summarize(load(path), args.top, args.steps)


if __name__ == "__main__":
    main()
