"""What a profiled step's timeline says about where its wall time went, from a torch profiler trace.

``benchmarks/train_gpu.py --profile DIR`` writes ``trace_RUN_rankR.json.gz``; this reads one and prints:
the GPU's time per stream and with nothing running, the longest idle gaps with the host operation
that was running when each began (what the GPU was waiting for), the CUDA runtime calls that took
the host longest (a synchronizing call shows up here), and the host operations with the most
self time::

    python benchmarks/trace_summary.py DIR/trace_tp2-sp-compile_rank0.json.gz
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


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


def innermost_op(ops: list[dict], starts: list[float], t: float) -> str:
    """The shortest host operation running at time ``t`` (``ops`` sorted by start)."""
    best = None
    for e in ops[max(0, bisect.bisect_right(starts, t) - 2000):bisect.bisect_right(starts, t)]:
        if e["ts"] <= t <= e["ts"] + e["dur"] and (best is None or e["dur"] < best["dur"]):
            best = e
    return best["name"][:90] if best else "(no host op)"


def summarize(events: list[dict], top: int) -> None:
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    if not gpu:
        raise SystemExit("no GPU events in this trace")
    lo = min(e["ts"] for e in gpu)
    hi = max(e["ts"] + e["dur"] for e in gpu)
    wall = hi - lo
    print(f"GPU window {wall / 1e3:.1f} ms")
    streams = collections.defaultdict(list)
    for e in gpu:
        streams[e.get("args", {}).get("stream", e.get("tid"))].append((e["ts"], e["ts"] + e["dur"]))
    for stream, iv in sorted(streams.items(), key=lambda kv: -span(kv[1])):
        names = collections.Counter(e["name"][:40] for e in gpu if e.get("args", {}).get("stream", e.get("tid")) == stream)
        print(f"  stream {stream}: busy {span(iv) / 1e3:8.1f} ms ({span(iv) / wall:5.1%}), {len(iv)} ops, "
              f"most {names.most_common(1)[0][0]!r}")
    nccl = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if "nccl" in e["name"].lower()]
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if "nccl" not in e["name"].lower()]
    busy = merged([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    print(f"  compute (not NCCL) {span(compute) / 1e3:.1f} ms ({span(compute) / wall:.1%}), NCCL {span(nccl) / 1e3:.1f} ms, "
          f"nothing running {(wall - span([(a, b) for a, b in busy])) / 1e3:.1f} ms")
    host = sorted((e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")),
                  key=lambda e: e["ts"])
    starts = [e["ts"] for e in host]
    gaps = sorted(((b_lo - a_hi, a_hi) for (_, a_hi), (b_lo, _) in zip(busy, busy[1:])), reverse=True)
    print(f"  {len(gaps)} idle gaps, {sum(g for g, _ in gaps) / 1e3:.1f} ms; longest, with the host op running as each began:")
    for gap, t in gaps[:top]:
        print(f"    {gap / 1e3:7.2f} ms at +{(t - lo) / 1e3:8.1f}  {innermost_op(host, starts, t)}")
    runtime = collections.defaultdict(lambda: [0.0, 0, 0.0])
    for e in events:
        if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver":
            r = runtime[e["name"]]
            r[0] += e["dur"]
            r[1] += 1
            r[2] = max(r[2], e["dur"])
    print("CUDA runtime calls by host time (total ms, calls, longest ms):")
    for name, (total, n, longest) in sorted(runtime.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {total / 1e3:8.2f} {n:6d} {longest / 1e3:8.2f}  {name}")
    threads = collections.Counter(e["tid"] for e in host)
    main = threads.most_common(1)[0][0] if threads else None
    mine = [e for e in host if e["tid"] == main]
    self_time = collections.defaultdict(float)
    stack: list[dict] = []
    for e in mine:  # self time: an op's duration less its direct children's
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
            stack.pop()
        if stack:
            self_time[stack[-1]["name"]] -= e["dur"]
        self_time[e["name"]] += e["dur"]
        stack.append(e)
    if mine:
        first, last = mine[0]["ts"], max(e["ts"] + e["dur"] for e in mine)
        print(f"host main thread: ops span {(last - first) / 1e3:.1f} ms; most self time (ms):")
        for name, t in sorted(self_time.items(), key=lambda kv: -kv[1])[:top]:
            print(f"  {t / 1e3:8.2f}  {name[:100]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    for path in args.traces:
        print(f"== {path}")
        summarize(load(path), args.top)


if __name__ == "__main__":
    main()
