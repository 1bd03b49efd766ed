"""Peak memory of `megazero curate run` as the corpus grows, shard size fixed.

Each size runs the real command in a child process; the figure is the largest resident set of that
process and its workers (``ru_maxrss`` of the children). Memory should follow ``--shard-docs``,
not the corpus: every task reads one shard or one hash partition of about a shard's size. The
stages are exact and fuzzy dedup unless ``--stages`` names others (decontaminate's tasks are 20
documents of the corpus; quality needs a model and is not offered).

    python benchmarks/curate_memory.py --docs 20000 100000 --shard-docs 10000
    python benchmarks/curate_memory.py --docs 1000000 --stages clean exact_dedup fuzzy_dedup decontaminate
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from curate_fuzzy import corpus  # noqa: E402


def write_corpus(docs: int, path: str, tasks: str) -> None:
    """The corpus and 20 task documents, written by a process that then exits.

    Linux counts in a child's ``ru_maxrss`` the resident set of the process it was forked from (the
    exec'd image starts from the parent's high-water mark), so a benchmark that held the corpus
    itself would report the corpus as the command's peak: 1.4 GB at 1M documents.
    """
    texts = corpus(docs + 20)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts[20:])
    with open(tasks, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts[:20])


def peak_rss_mb(docs: int, shard_docs: int, workers: int, stages: list[str]) -> tuple[float, float]:
    """(peak RSS in MB of the run's processes, wall seconds) for a corpus of ``docs`` documents."""
    with tempfile.TemporaryDirectory() as tmp:
        path, tasks = os.path.join(tmp, "docs.jsonl"), os.path.join(tmp, "tasks.jsonl")
        writer = mp.get_context("spawn").Process(target=write_corpus, args=(docs, path, tasks))
        writer.start()  # in a process of its own: see write_corpus
        writer.join()
        config = os.path.join(tmp, "curate.yaml")
        with open(config, "w") as f:
            json.dump({"input": {"paths": [path], "shard_docs": shard_docs},
                       "output": {"dir": os.path.join(tmp, "out")}, "executor": {"workers": workers},
                       "stages": stages, "clean": {"min_words": 20}, "decontaminate": {"tasks": [tasks]}}, f)
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
    parser.add_argument("--stages", nargs="+", default=["exact_dedup", "fuzzy_dedup"],
                        choices=["clean", "exact_dedup", "fuzzy_dedup", "decontaminate"])
    args = parser.parse_args()
    for n in args.docs:
        mb, wall = peak_rss_mb(n, args.shard_docs, args.workers, args.stages)
        print(f"{n:>9} documents, shards of {args.shard_docs}, {' '.join(args.stages)}: peak RSS {mb:.0f} MB "
              f"({wall:.0f} s wall, {args.workers} workers)", flush=True)


if __name__ == "__main__":
    main()
