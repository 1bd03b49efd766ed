"""Documents per second of each curation stage on one worker, on the fuzzy benchmark's prose corpus.

The quality model is trained on the fly (the stdlib's prose as hq, word salad as lq); the
decontamination tasks are 20 held-out documents. Each stage's figure is its documents over the
CPU seconds of this process while it ran (one worker, so one core), and its wall seconds.
``--accents F`` gives a share F of the lines a non-ASCII character (curly quotes, an accented
word), as web text has, so the clean stage's plain-ASCII shortcut is measured on text where it
helps less; ``--stages`` times only some stages (ingest is never counted).

    python benchmarks/curate_stages.py --docs 10000
    python benchmarks/curate_stages.py --docs 10000 --stages clean decontaminate --accents 1.0
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from curate_fuzzy import corpus  # noqa: E402

from data_pipeline.curate import pipeline  # noqa: E402
from data_pipeline.curate.config import STAGES, build_config  # noqa: E402
from data_pipeline.curate.demo import word_salad, write_jsonl  # noqa: E402
from data_pipeline.curate.quality import train_quality  # noqa: E402

ORDER = ["clean", "quality", "exact_dedup", "fuzzy_dedup", "decontaminate"]
ACCENTS = ("\u201cquoted\u201d", "caf\u00e9", "na\u00efve", "it\u2019s", "\u2014")


def accented(text: str, share: float, rng: random.Random) -> str:
    """``text`` with a share of its sentences given one non-ASCII word."""
    parts = text.split(". ")
    return ". ".join(f"{p} {rng.choice(ACCENTS)}" if rng.random() < share else p for p in parts)


def timed_runners(cpu: dict) -> None:
    """Wrap each stage's runner so that its CPU seconds land in ``cpu``."""
    for name, runner in list(pipeline.RUNNERS.items()):
        def timed(ctx, shards, out_dir, _runner=runner, _name=name):
            start = time.process_time()
            try:
                return _runner(ctx, shards, out_dir)
            finally:
                cpu[_name] = time.process_time() - start
        pipeline.RUNNERS[name] = timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=10000)
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=ORDER)
    parser.add_argument("--accents", type=float, default=0.0, help="share of sentences given a non-ASCII word")
    args = parser.parse_args()
    rng = random.Random(0)
    texts = [accented(t, args.accents, rng) for t in corpus(args.docs + 20, seed=1)]
    tasks, texts = texts[:20], texts[20:]
    cpu: dict = {}
    timed_runners(cpu)
    with tempfile.TemporaryDirectory() as tmp:
        docs = write_jsonl(os.path.join(tmp, "docs.jsonl"), texts)
        task = write_jsonl(os.path.join(tmp, "task.jsonl"), tasks)
        raw = {"input": {"paths": [docs], "shard_docs": 2000}, "output": {"dir": os.path.join(tmp, "out")},
               "stages": [s for s in ORDER if s in args.stages], "clean": {"min_words": 20},
               "decontaminate": {"tasks": [task]}}
        if "quality" in args.stages:
            vocab = sorted({w for t in texts[:500] for w in t.split() if w.isalpha()})
            hq = write_jsonl(os.path.join(tmp, "hq.jsonl"), texts[:500])
            lq = write_jsonl(os.path.join(tmp, "lq.jsonl"), word_salad(vocab, rng, 500))
            raw["quality"] = {"model": os.path.join(tmp, "q.bin")}
            train_quality([hq], [lq], raw["quality"]["model"], epoch=10)
        for s in pipeline.run_pipeline(build_config(raw), log=lambda s: None)["stages"][1:]:
            print(f"{s['stage']:>14}: {s['docs_in'] / cpu[s['stage']]:8.0f} docs per CPU-second "
                  f"({s['docs_in']} documents, {cpu[s['stage']]:.2f} CPU s, {s['seconds']:.2f} s wall, "
                  f"{s['docs_out']} kept)")


if __name__ == "__main__":
    main()
