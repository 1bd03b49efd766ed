"""Preprocessing throughput at 1 and 2 workers against the tokenizer's own raw encode speed.

    python benchmarks/data_preprocess.py --mb 16 --out-dir /some/scratch/dir

The text is the demo corpus (the Python standard library's source, as jsonl) and the tokenizer
the demo SentencePiece model trained on it. "Raw encode" is the ceiling: the same documents,
already in memory as Python strings, encoded in batches on one thread with nothing else (no file
reading, no json, no writing). Each figure is the best of ``--repeats`` runs.

Besides wall-clock rates the script reports MB per CPU-second (user + system time of this process
and its workers). On a shared machine the wall-clock figures depend on what else runs; the CPU-time
efficiency (preprocess MB per CPU-second over raw encode MB per CPU-second) does not, and it is the
"share of the ceiling per worker" that the work itself achieves.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time

from data_pipeline.demo_corpus import write_stdlib_jsonl
from data_pipeline.preprocess import preprocess
from data_pipeline.tokenizer import load_tokenizer, read_texts, train_sentencepiece


def cpu_seconds() -> float:
    """User + system time of this process and of its finished children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def measured(fn):
    """(wall seconds, CPU seconds, result) of one call."""
    wall, cpu = time.perf_counter(), cpu_seconds()
    out = fn()
    return time.perf_counter() - wall, cpu_seconds() - cpu, out


def raw_encode(tokenizer, texts: list[str], batch: int) -> None:
    for i in range(0, len(texts), batch):
        tokenizer.encode_batch(texts[i:i + batch])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=16.0, help="MB of text to process")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--tokenizer", default=None, help="Use this tokenizer instead of training the demo one")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    out = args.out_dir or tempfile.mkdtemp(prefix="megazero-bench-")
    jsonl = os.path.join(out, "corpus.jsonl")
    docs, nbytes = write_stdlib_jsonl(jsonl, int(args.mb * 1e6))
    model = args.tokenizer or train_sentencepiece(read_texts([jsonl]), os.path.join(out, "tok"), args.vocab_size,
                                                  max_sentences=200_000)
    tokenizer = load_tokenizer(model)
    with open(jsonl) as f:
        texts = [json.loads(line)["text"] for line in f]
    print(f"{docs} documents, {nbytes / 1e6:.1f} MB, tokenizer {os.path.basename(model)} "
          f"({tokenizer.vocab_size} pieces)")
    mb = nbytes / 1e6
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print("| run | docs/s | MB/s | wall share of ceiling per worker | MB per CPU-s | CPU-time efficiency |")
    print("| --- | --- | --- | --- | --- | --- |")
    runs = [measured(lambda: raw_encode(tokenizer, texts, args.batch_size)) for _ in range(args.repeats)]
    raw_wall, raw_cpu = min(r[0] for r in runs), min(r[1] for r in runs)
    print(f"| raw encode, 1 thread | {docs / raw_wall:,.0f} | {mb / raw_wall:.2f} | 100% | {mb / raw_cpu:.2f} | 100% |")
    for workers in (1, 2):
        prefix = os.path.join(out, f"w{workers}")
        runs = [measured(lambda w=workers, p=prefix: preprocess([jsonl], p, model, workers=w, batch_size=args.batch_size))
                for _ in range(args.repeats)]
        wall, cpu = min(r[0] for r in runs), min(r[1] for r in runs)
        print(f"| preprocess, {workers} worker(s) | {docs / wall:,.0f} | {mb / wall:.2f} | "
              f"{mb / wall / workers / (mb / raw_wall):.0%} | {mb / cpu:.2f} | {raw_cpu / cpu:.0%} |")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
