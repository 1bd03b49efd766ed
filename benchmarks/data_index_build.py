"""Index build time for a synthetic dataset: our writer vs megatron-core's IndexedDatasetBuilder,
our numpy sample index vs megatron-core's compiled helper, our greedy blend loop vs its helper.

    python benchmarks/data_index_build.py --tokens 1e9 --out-dir /some/scratch/dir

Documents are uniform random in length (1..2*mean-1 tokens) with random uint16 tokens; generating
them is not timed. Writes go to the page cache (no fsync, for any writer); the page cache is
flushed (``os.sync``, untimed) before each write so none pays for another's writeback. Each writer
runs ``--repeats`` times, the best is reported. The shards are checked byte-identical, then deleted.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings

import numpy as np

from data_pipeline.blend import greedy_blend
from data_pipeline.gpt_samples import build_document_index, build_sample_index
from data_pipeline.indexed import IndexedDataset, IndexedDatasetWriter


def synthetic(num_tokens: int, mean_doc: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 2 * mean_doc, size=int(num_tokens / mean_doc * 1.1), dtype=np.int64)
    ends = np.cumsum(lengths)
    n = int(np.searchsorted(ends, num_tokens)) + 1
    lengths = lengths[:n]
    lengths[-1] -= int(ends[n - 1]) - num_tokens
    tokens = rng.integers(0, 32000, size=num_tokens, dtype=np.uint16)
    return tokens, lengths


def timed(fn):
    """(wall seconds, CPU seconds of this process, result)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def write_ours_batched(prefix, tokens, lengths, batch_docs=16384):
    ends = np.concatenate([[0], np.cumsum(lengths)])
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for i in range(0, len(lengths), batch_docs):
            j = min(i + batch_docs, len(lengths))
            w.add_documents(tokens[ends[i]:ends[j]], lengths[i:j])


def write_ours_per_doc(prefix, tokens, lengths):
    ends = np.concatenate([[0], np.cumsum(lengths)])
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for i in range(len(lengths)):
            w.add_document(tokens[ends[i]:ends[i + 1]])


def write_megatron(prefix, tokens, lengths):
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    ends = np.concatenate([[0], np.cumsum(lengths)])
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for i in range(len(lengths)):  # as megatron's preprocess_data.py feeds it: one document per call
        builder.add_item(torch.from_numpy(tokens[ends[i]:ends[i + 1]]))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=1e9)
    parser.add_argument("--mean-doc", type=int, default=1000, help="Mean document length in tokens")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--blend-samples", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=2, help="Runs of each writer; the best is reported")
    parser.add_argument("--out-dir", default=None, help="Scratch directory (default: a temporary one)")
    args = parser.parse_args()
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="megazero-bench-")
    os.makedirs(out_dir, exist_ok=True)
    tokens, lengths = synthetic(int(args.tokens), args.mean_doc)
    print(f"synthetic dataset: {len(tokens):,} tokens in {len(lengths):,} documents ({tokens.nbytes / 1e9:.2f} GB)")

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core.datasets.indexed_dataset  # noqa: F401
            from megatron.core.datasets import helpers
    except ImportError as exc:
        helpers = None
        print(f"megatron-core not importable ({exc}); its columns are skipped")

    ours, per_doc, theirs = (os.path.join(out_dir, n) for n in ("ours", "ours_per_doc", "megatron"))
    writers = [("write .bin/.idx, ours, batched (16k documents a call)", lambda: write_ours_batched(ours, tokens, lengths)),
               ("write .bin/.idx, ours, one call per document", lambda: write_ours_per_doc(per_doc, tokens, lengths))]
    if helpers is not None:
        writers.append(("write .bin/.idx, megatron-core IndexedDatasetBuilder, one call per document",
                        lambda: write_megatron(theirs, tokens, lengths)))
    best = {name: (float("inf"), float("inf")) for name, _ in writers}
    for _ in range(args.repeats):
        for name, fn in writers:
            os.sync()  # start each write with no dirty pages of the previous one still being flushed
            wall, cpu, _ = timed(fn)
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    rows = [(name, wall, cpu) for name, (wall, cpu) in best.items()]
    t_open, c_open, ds = timed(lambda: IndexedDataset(ours))
    rows.append(("open + validate, ours", t_open, c_open))
    if helpers is not None:
        for ext in (".idx", ".bin"):
            with open(ours + ext, "rb") as a, open(theirs + ext, "rb") as b:
                while True:
                    x, y = a.read(1 << 26), b.read(1 << 26)
                    assert x == y, f"{ext} differs between the writers"
                    if not x:
                        break
        print("ours and megatron-core's shards are byte-identical")

    sizes = np.asarray(ds.sizes)
    doc_index = build_document_index(np.arange(len(sizes)), 1, np.random.RandomState(0), False)
    wall, cpu, sample_index = timed(lambda: build_sample_index(sizes, doc_index, args.seq_len))
    rows.append((f"GPT sample index ({len(sample_index) - 1:,} samples of {args.seq_len}), ours numpy", wall, cpu))
    if helpers is not None:
        wall, cpu, theirs_index = timed(lambda: helpers.build_sample_idx(sizes, doc_index, args.seq_len, 1,
                                                                         int(sizes.sum()), True, True))
        assert np.array_equal(sample_index, theirs_index)
        rows.append(("GPT sample index, megatron-core C++ helper", wall, cpu))
    weights = [0.19336, 0.14336, 0.15652, 0.13017, 0.09446, 0.08962, 0.05689, 0.04771, 0.02897, 0.01588,
               0.01359, 0.01007, 0.00873, 0.00859, 0.00208]
    # both blends warm (our library loaded, theirs imported), then alternating, the best of --repeats each;
    # ours allocates its two output arrays in every call, theirs fills arrays made once (in its favour)
    ours = lambda: greedy_blend(weights, args.blend_samples)  # noqa: E731
    w = np.asarray(weights) / np.sum(weights)
    d, s = np.zeros(args.blend_samples, np.int16), np.zeros(args.blend_samples, np.int64)
    theirs = lambda: helpers.build_blending_indices(d, s, w, len(w), args.blend_samples, False)  # noqa: E731
    runs = [("ours", ours)] + ([("megatron-core C++ helper", theirs)] if helpers is not None else [])
    for _, fn in runs:
        fn()
    best: dict[str, tuple[float, float]] = {}
    for _ in range(max(args.repeats, 1)):
        for name, fn in runs:
            best[name] = min(best.get(name, (float("inf"),) * 2), timed(fn)[:2])
    if helpers is not None:
        mine = ours()
        assert np.array_equal(mine[0], d) and np.array_equal(mine[1], s), "blends differ"
    for name, (wall, cpu) in best.items():
        rows.append((f"blend of {args.blend_samples:,} samples over 15 datasets, {name}", wall, cpu))

    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print("| step | wall | CPU (user + sys) |\n| --- | --- | --- |")
    for name, wall, cpu in rows:
        print(f"| {name} | {wall:.3f} s | {cpu:.3f} s |")
    for name in ("ours", "ours_per_doc", "megatron"):
        for ext in (".bin", ".idx"):
            path = os.path.join(out_dir, name + ext)
            if os.path.exists(path):
                os.unlink(path)


if __name__ == "__main__":
    main()
