"""Peak memory of `megazero curate run` (exact and fuzzy dedup) as the corpus grows, shard size fixed.

Each size runs the real command in a child process; the figure is the largest resident set of that
process and its workers (``ru_maxrss`` of the children). Memory should follow ``--shard-docs``,
not the corpus: every task reads one shard or one hash partition of about a shard's size.

    python benchmarks/curate_memory.py --docs 20000 100000 --shard-docs 10000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from curate_fuzzy import corpus  # noqa: E402


def peak_rss_mb(docs: int, shard_docs: int, workers: int) -> tuple[float, float]:
    """(peak RSS in MB of the run's processes, wall seconds) for a corpus of ``docs`` documents."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "docs.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in corpus(docs))
        config = os.path.join(tmp, "curate.yaml")
        with open(config, "w") as f:
            json.dump({"input": {"paths": [path], "shard_docs": shard_docs},
                       "output": {"dir": os.path.join(tmp, "out")}, "executor": {"workers": workers},
                       "stages": ["exact_dedup", "fuzzy_dedup"]}, f)
        script = ("import resource, sys; from megazero.cli import main; code = main(sys.argv[1:]); "
                  "print('PEAK', max(resource.getrusage(w).ru_maxrss for w in "
                  "(resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))); sys.exit(code)")
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", script, "curate", "run", config, "--no-progress"],
                             check=True, capture_output=True, text=True).stdout
        peak_kb = int(out.split("PEAK")[-1].split()[0])
        return peak_kb / 1024, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, nargs="+", default=[20000, 100000])
    parser.add_argument("--shard-docs", type=int, default=10000)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    for n in args.docs:
        mb, wall = peak_rss_mb(n, args.shard_docs, args.workers)
        print(f"{n:>9} documents, shards of {args.shard_docs}: peak RSS {mb:.0f} MB ({wall:.0f} s wall, "
              f"{args.workers} workers)")


if __name__ == "__main__":
    main()
