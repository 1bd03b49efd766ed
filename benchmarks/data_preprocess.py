"""Preprocessing throughput at 1 and 2 workers against the tokenizer's own raw encode speed.

    python benchmarks/data_preprocess.py --mb 16 --out-dir /some/scratch/dir

The text is the demo corpus (the Python standard library's source, as jsonl) and the tokenizer
the demo SentencePiece model trained on it. "Raw encode" is the ceiling: the same documents,
already in memory as Python strings, encoded in batches on one thread with nothing else (no file
reading, no json, no writing). Each figure is the best of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from data_pipeline.demo_corpus import write_stdlib_jsonl
from data_pipeline.preprocess import preprocess
from data_pipeline.tokenizer import load_tokenizer, read_texts, train_sentencepiece


def raw_encode(tokenizer, texts: list[str], batch: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(texts), batch):
        tokenizer.encode_batch(texts[i:i + batch])
    return time.perf_counter() - start


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
    raw = min(raw_encode(tokenizer, texts, args.batch_size) for _ in range(args.repeats))
    print(f"| raw encode, 1 thread | {docs / raw:,.0f} docs/s | {nbytes / 1e6 / raw:.2f} MB/s | 100% |")
    for workers in (1, 2):
        best = None
        for _ in range(args.repeats):
            stats = preprocess([jsonl], os.path.join(out, f"w{workers}"), model, workers=workers,
                               batch_size=args.batch_size)
            best = stats if best is None or stats.seconds < best.seconds else best
        per_worker = best.mb_per_s / workers / (nbytes / 1e6 / raw)
        print(f"| megazero preprocess, {workers} worker(s) | {best.docs_per_s:,.0f} docs/s | "
              f"{best.mb_per_s:.2f} MB/s | {per_worker:.0%} per worker |")


if __name__ == "__main__":
    main()
