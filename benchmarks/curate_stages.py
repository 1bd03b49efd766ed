"""Documents per second of each curation stage on one worker, on the fuzzy benchmark's prose corpus.

The quality model is trained on the fly (the stdlib's prose as hq, word salad as lq); the
decontamination tasks are 20 held-out documents. Seconds are each stage's wall time from its
stats.json (one worker, so one core).

    python benchmarks/curate_stages.py --docs 10000
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from curate_fuzzy import corpus  # noqa: E402
from data_pipeline.curate.config import build_config  # noqa: E402
from data_pipeline.curate.demo import word_salad, write_jsonl  # noqa: E402
from data_pipeline.curate.pipeline import run_pipeline  # noqa: E402
from data_pipeline.curate.quality import train_quality  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=10000)
    args = parser.parse_args()
    texts = corpus(args.docs + 20, seed=1)
    tasks, texts = texts[:20], texts[20:]
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        docs = write_jsonl(os.path.join(tmp, "docs.jsonl"), texts)
        task = write_jsonl(os.path.join(tmp, "task.jsonl"), tasks)
        vocab = sorted({w for t in texts[:500] for w in t.split() if w.isalpha()})
        hq = write_jsonl(os.path.join(tmp, "hq.jsonl"), texts[:500])
        lq = write_jsonl(os.path.join(tmp, "lq.jsonl"), word_salad(vocab, rng, 500))
        model = os.path.join(tmp, "q.bin")
        train_quality([hq], [lq], model, epoch=10)
        raw = {"input": {"paths": [docs], "shard_docs": 2000}, "output": {"dir": os.path.join(tmp, "out")},
               "stages": ["clean", "quality", "exact_dedup", "fuzzy_dedup", "decontaminate"],
               "clean": {"min_words": 20}, "quality": {"model": model}, "decontaminate": {"tasks": [task]}}
        for s in run_pipeline(build_config(raw), log=lambda s: None)["stages"][1:]:
            print(f"{s['stage']:>14}: {s['docs_in'] / s['seconds']:8.0f} docs/s ({s['docs_in']} documents in "
                  f"{s['seconds']:.2f} s, {s['docs_out']} kept)")


if __name__ == "__main__":
    main()
