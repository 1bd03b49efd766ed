"""Fuzzy dedup's scaling with workers: the real stage on the same ingested shards with 1, 2, 4, ...
worker processes (wall time, documents per second, speedup over one worker), and the same removed
count every time. Needs an otherwise idle machine with that many cores. Each width gets one
worker pool for all five sub-stages, started inside the timed region, as a real run does.
``task_bound`` is the speedup the shard count allows at that width (the sub-stages run one task per
shard or partition, in waves): give at least four shards per worker of the widest run.
``substages`` gives each sub-stage's seconds, to see which one scales worst.
``control_speedup`` is what the machine itself allows: the same shards' MinHash signatures computed
by a plain process pool of that width, each shard on its own with nothing written and no sub-stage
barriers. Cores that slow down when all are busy (a lower all-core clock, shared memory bandwidth)
cap it below the width; ``speedup`` over ``control_speedup`` is then the share of the machine's
own scaling that the pipeline keeps.

    python benchmarks/curate_scaling.py --docs 200000 --shard-docs 1250 --workers 1 4 16 32
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from curate_fuzzy import BANDS, NGRAM, NUM_PERM, ROWS, THRESHOLD, corpus  # noqa: E402

from data_pipeline.curate.config import build_config  # noqa: E402
from data_pipeline.curate.fuzzy_dedup import BATCH  # noqa: E402
from data_pipeline.curate.pipeline import Context, run_fuzzy_dedup, run_pipeline  # noqa: E402
from data_pipeline.curate.runner import LocalExecutor  # noqa: E402
from data_pipeline.curate.shards import list_shards, read_shard  # noqa: E402


def task_bound(tasks: int, workers: int) -> float:
    """The best speedup ``workers`` can reach on sub-stages of ``tasks`` equal tasks each: they run in
    ceil(tasks / workers) waves where one worker needs ``tasks``. A speedup below it comes from the
    serial parts; at it, from the task count (more, smaller shards raise it)."""
    return tasks / math.ceil(tasks / workers)


class TimedContext(Context):
    """The pipeline's context, timing each sub-stage (each ``run`` of a task list)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seconds: dict[str, float] = {}

    def run(self, directory, tasks, desc):
        start = time.perf_counter()
        try:
            return super().run(directory, tasks, desc)
        finally:
            self.seconds[desc.removeprefix("fuzzy: ")] = round(time.perf_counter() - start, 2)


def _hash_shard(job: tuple) -> int:
    path, text_field, cfg = job
    hasher = cfg.hasher()
    texts = [r[text_field] for r in read_shard(path)]
    for i in range(0, len(texts), BATCH):
        hasher.band_keys(hasher.signatures(*hasher.shingles(texts[i:i + BATCH])))
    return len(texts)


def control_seconds(shards: list[str], text_field: str, cfg, workers: int) -> float:
    """Wall time of hashing every shard in a plain pool of ``workers`` processes (one: in this one)."""
    jobs = [(s, text_field, cfg) for s in shards]
    start = time.perf_counter()
    if workers == 1:
        list(map(_hash_shard, jobs))
    else:
        with mp.get_context("fork").Pool(workers) as pool:
            list(pool.imap_unordered(_hash_shard, jobs))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=200000)
    parser.add_argument("--shard-docs", type=int, default=5000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    texts = corpus(args.docs)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "docs.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(texts))
        cfg = build_config({"input": {"paths": [path], "shard_docs": args.shard_docs},
                            "output": {"dir": os.path.join(tmp, "out")}, "stages": [],
                            "fuzzy_dedup": {"num_perm": NUM_PERM, "bands": BANDS, "rows": ROWS, "ngram": NGRAM,
                                            "threshold": THRESHOLD}})
        run_pipeline(cfg, log=lambda s: None)  # ingest only: not timed
        shards = list_shards(os.path.join(tmp, "out", "00-input"))
        base = control_base = None
        for workers in args.workers:
            control = control_seconds(shards, cfg.input.text_field, cfg.fuzzy_dedup, workers)
            control_base = control_base or control
            executor = LocalExecutor(workers)
            start = time.perf_counter()
            ctx = TimedContext(cfg, executor, progress=False)
            try:
                stats = run_fuzzy_dedup(ctx, shards, os.path.join(tmp, f"fuzzy-{workers}"))
            finally:
                executor.close()
            seconds = time.perf_counter() - start
            base = base or seconds
            print(json.dumps({"workers": workers, "docs": args.docs, "seconds": round(seconds, 2),
                              "docs_per_s": round(args.docs / seconds), "speedup": round(base / seconds, 2),
                              "task_bound": round(task_bound(len(shards), workers), 2),
                              "control_speedup": round(control_base / control, 2),
                              "removed": stats["dropped"].get("near duplicate", 0), "substages": ctx.seconds}),
                  flush=True)


if __name__ == "__main__":
    main()
