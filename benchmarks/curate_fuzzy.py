"""Fuzzy dedup end to end on one core (texts in -> components out): megazero against datasketch and rensa.

Same corpus, same parameters for all three: character 5-gram shingles, 260 permutations, LSH with
20 bands x 13 rows, candidates verified by exact Jaccard >= 0.8, connected components. The peers
get the shingles as Python strings (what their APIs take), and share one exact-Jaccard check and
one union-find, so the difference is MinHash and LSH. megazero runs its real stage (shards on disk,
sub-stages, one worker). Times are CPU seconds of this process (documents per core-second), which
a busy shared machine disturbs much less than wall time; wall time is printed too.

    pip install datasketch rensa
    python benchmarks/curate_fuzzy.py --docs 4000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data_pipeline.curate.config import build_config  # noqa: E402
from data_pipeline.curate.demo import NEAR_KINDS, near_duplicate, stdlib_prose  # noqa: E402
from data_pipeline.curate.pipeline import Context, run_fuzzy_dedup, run_pipeline  # noqa: E402
from data_pipeline.curate.runner import LocalExecutor  # noqa: E402
from data_pipeline.curate.shards import list_shards  # noqa: E402

NUM_PERM, BANDS, ROWS, NGRAM, THRESHOLD = 260, 20, 13, 5, 0.8


def corpus(n: int, seed: int = 0) -> list[str]:
    """Real prose, mostly distinct documents with a tenth planted near-duplicates (as after exact dedup).

    The stdlib has about a thousand prose documents; more distinct ones are made by drawing eight
    random sentences from all of them, which reads like prose and shares few 5-grams with the rest.
    """
    rng = random.Random(seed)
    prose = stdlib_prose(max_docs=n)
    sentences = [s for d in prose for s in re.split(r"(?<=[.!?])\s+", d) if len(s) > 40]
    base = prose[:n - n // 10]
    while len(base) < n - n // 10:
        base.append(" ".join(rng.choice(sentences) for _ in range(8)))
    texts = base + [near_duplicate(base[rng.randrange(len(base))], NEAR_KINDS[i % 4], rng) for i in range(n // 10)]
    rng.shuffle(texts)
    return texts


def shingles(text: str) -> list[str]:
    return [text[i:i + NGRAM] for i in range(max(1, len(text) - NGRAM + 1))]


def verify_and_components(texts: list[str], candidates) -> int:
    """Exact Jaccard on candidate pairs, then union-find; returns the number of documents removed."""
    sets = {}
    parent = list(range(len(texts)))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in candidates:
        sa = sets.setdefault(a, set(shingles(texts[a])))
        sb = sets.setdefault(b, set(shingles(texts[b])))
        if len(sa & sb) >= THRESHOLD * len(sa | sb):
            ra, rb = find(a), find(b)
            parent[max(ra, rb)] = min(ra, rb)
    return sum(find(i) != i for i in range(len(texts)))


def run_datasketch(texts: list[str]) -> int:
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(num_perm=NUM_PERM, params=(BANDS, ROWS))
    hashes = []
    for i, t in enumerate(texts):
        m = MinHash(num_perm=NUM_PERM, seed=1)
        m.update_batch([s.encode("utf-8") for s in shingles(t)])
        lsh.insert(i, m)
        hashes.append(m)
    candidates = {(min(i, j), max(i, j)) for i, m in enumerate(hashes) for j in lsh.query(m) if j != i}
    return verify_and_components(texts, sorted(candidates))


def run_rensa(texts: list[str]) -> int:
    from rensa import RMinHash, RMinHashLSH

    lsh = RMinHashLSH(threshold=THRESHOLD, num_perm=NUM_PERM, num_bands=BANDS)
    hashes = []
    for i, t in enumerate(texts):
        m = RMinHash(num_perm=NUM_PERM, seed=1)
        m.update(shingles(t))
        lsh.insert(i, m)
        hashes.append(m)
    candidates = {(min(i, j), max(i, j)) for i, m in enumerate(hashes) for j in lsh.query(m) if j != i}
    return verify_and_components(texts, sorted(candidates))


def run_megazero(texts: list[str]) -> int:
    """The real stage on shards already ingested (one worker, in this process); ingest is not timed."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "docs.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(texts))
        raw = {"input": {"paths": [path], "shard_docs": 2000}, "output": {"dir": os.path.join(tmp, "out")},
               "stages": [], "executor": {"workers": 1},
               "fuzzy_dedup": {"num_perm": NUM_PERM, "bands": BANDS, "rows": ROWS, "ngram": NGRAM,
                               "threshold": THRESHOLD}}
        cfg = build_config(raw)
        run_pipeline(cfg, log=lambda s: None)
        ctx = Context(cfg, LocalExecutor(1), progress=False)
        cpu, wall = time.process_time(), time.perf_counter()
        stats = run_fuzzy_dedup(ctx, list_shards(os.path.join(tmp, "out", "00-input")), os.path.join(tmp, "fuzzy"))
        return stats["dropped"].get("near duplicate", 0), time.process_time() - cpu, time.perf_counter() - wall


def timed(fn, texts):
    """(CPU seconds, wall seconds, documents removed); a runner may time its own part and return it."""
    cpu, wall = time.process_time(), time.perf_counter()
    removed = fn(texts)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return (removed[1], removed[2], removed[0]) if isinstance(removed, tuple) else (cpu, wall, removed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=4000)
    parser.add_argument("--repeat", type=int, default=3, help="best of this many runs each")
    parser.add_argument("--only", nargs="+", default=["megazero", "rensa", "datasketch"])
    args = parser.parse_args()
    texts = corpus(args.docs)
    chars = sum(map(len, texts)) / len(texts)
    print(f"{len(texts)} documents, {chars:.0f} characters on average; 260 permutations, 20 x 13, char 5-grams")
    runners = {"megazero": run_megazero, "rensa": run_rensa, "datasketch": run_datasketch}
    for name in args.only:
        best = min((timed(runners[name], texts) for _ in range(args.repeat if name != "datasketch" else 1)),
                   key=lambda r: r[0])
        cpu, wall, removed = best
        print(f"{name:>10}: {len(texts) / cpu:8.0f} docs per CPU-second ({cpu:.2f} s CPU, {wall:.2f} s wall), "
              f"{removed} near-duplicates removed")
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
