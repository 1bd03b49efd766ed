"""``decontaminate``: cut evaluation-task 13-grams out of the training documents (GPT-3 / MT-NLG rules).

Text is compared as lower-cased words (``\\w+``, so punctuation and spacing do not matter). For
every 13-gram of a document that also occurs in a task, the match plus ``margin`` (200) characters
on each side is removed; the document falls apart into the pieces between removals, pieces under
``min_piece_chars`` (200) are dropped, and a document split more than ``max_splits`` (10) times is
dropped whole. 13-grams found in ``max_doc_freq`` (10) or more training documents are common
phrases rather than leaked test items, and are ignored; counting them is the ``doc_freq``
sub-stage, which runs first over every shard.
"""

from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass, field

import numpy as np

from data_pipeline.curate.exact_dedup import save_array
from data_pipeline.curate.shards import BadRecords, input_documents, read_shard, write_shard

_WORD = re.compile(r"\w+")


@dataclass
class DecontaminateConfig:
    tasks: list = field(default_factory=list)  # jsonl/parquet files of evaluation texts, one task per file
    task_fields: list = field(default_factory=lambda: ["text"])  # fields of a task record that hold text
    ngram: int = 13
    margin: int = 200  # characters removed on each side of a match
    min_piece_chars: int = 200  # shorter pieces left after removal are dropped
    max_splits: int = 10  # a document split more often is dropped
    max_doc_freq: int = 10  # n-grams in this many training documents or more are ignored


class NgramKeys:
    """64-bit keys of word n-grams: crc32 of each lower-cased word, folded with fixed odd multipliers."""

    def __init__(self, n: int) -> None:
        self.n = n
        rng = np.random.default_rng(13)
        self.mul = rng.integers(0, 2**63, n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)

    def words(self, text: str) -> tuple[np.ndarray, list]:
        matches = list(_WORD.finditer(text))
        hashes = np.fromiter((zlib.crc32(m.group().lower().encode("utf-8")) for m in matches), dtype=np.uint64,
                             count=len(matches))
        return hashes, [m.span() for m in matches]

    def keys(self, word_hashes: np.ndarray) -> np.ndarray:
        windows = len(word_hashes) - self.n + 1
        if windows <= 0:
            return np.zeros(0, np.uint64)
        key = word_hashes[:windows] * self.mul[0]
        for k in range(1, self.n):
            key += word_hashes[k:k + windows] * self.mul[k]
        return key


def build_task_ngrams(cfg: DecontaminateConfig, out_path: str) -> dict:
    """Every task's n-gram keys, sorted, with the task each came from; returns per-task counts."""
    if not cfg.tasks:
        raise ValueError("decontaminate.tasks: no task files; list jsonl files of evaluation texts "
                         "(their decontaminate.task_fields hold the text)")
    ngrams = NgramKeys(cfg.ngram)
    keys, owner, names, short = [], [], [], {}
    for t, path in enumerate(cfg.tasks):
        names.append(os.path.splitext(os.path.basename(path).removesuffix(".gz").removesuffix(".zst"))[0])
        short[names[-1]] = 0
        for _, record in input_documents(path, cfg.task_fields[0], "id", False, BadRecords()):
            for name in cfg.task_fields:
                if isinstance(record.get(name), str):
                    k = ngrams.keys(ngrams.words(record[name])[0])
                    short[names[-1]] += not len(k)
                    keys.append(k)
                    owner.append(np.full(len(k), t, np.int32))
    keys, owner = np.concatenate(keys or [np.zeros(0, np.uint64)]), np.concatenate(owner or [np.zeros(0, np.int32)])
    keys, first = np.unique(keys, return_index=True)
    tmp = f"{out_path}.tmp-{os.getpid()}.npz"
    np.savez(tmp, keys=keys, task=owner[first], names=np.array(names))
    os.replace(tmp, out_path)
    return {"task_ngrams": len(keys), "task_texts_shorter_than_ngram": short}


def _load_tasks(path: str):
    data = np.load(path)
    return data["keys"], data["task"], [str(n) for n in data["names"]]


def doc_freq_shard(in_path: str, tasks_path: str, out_path: str, text_field: str, n: int) -> dict:
    """(task n-gram key, number of this shard's documents containing it)."""
    keys, _, _ = _load_tasks(tasks_path)
    ngrams = NgramKeys(n)
    found = []
    for record in read_shard(in_path):
        k = ngrams.keys(ngrams.words(record[text_field])[0])
        found.append(np.unique(k[np.isin(k, keys)]))
    found = np.concatenate(found) if found else np.zeros(0, np.uint64)
    uniq, counts = np.unique(found, return_counts=True)
    save_array(out_path, np.stack([uniq, counts.astype(np.uint64)], axis=1))
    return {"docs": 0}


def frequent_ngrams(freq_paths: list[str], max_doc_freq: int) -> np.ndarray:
    pairs = np.concatenate([np.load(p).reshape(-1, 2) for p in freq_paths])
    uniq, inverse = np.unique(pairs[:, 0], return_inverse=True)
    totals = np.bincount(inverse, weights=pairs[:, 1].astype(np.float64), minlength=len(uniq))
    return uniq[totals >= max_doc_freq]


def cut(text: str, spans: list, hit_windows: np.ndarray, cfg: DecontaminateConfig) -> list[str] | None:
    """The pieces of ``text`` left after removing each hit window plus the margin; None = drop it all."""
    removed = []
    for i in hit_windows.tolist():
        lo, hi = max(0, spans[i][0] - cfg.margin), min(len(text), spans[i + cfg.ngram - 1][1] + cfg.margin)
        if removed and lo <= removed[-1][1]:
            removed[-1][1] = max(removed[-1][1], hi)
        else:
            removed.append([lo, hi])
    if len(removed) > cfg.max_splits:
        return None
    bounds = [0] + [x for r in removed for x in r] + [len(text)]
    pieces = [text[bounds[k]:bounds[k + 1]].strip() for k in range(0, len(bounds), 2)]
    return [p for p in pieces if len(p) >= cfg.min_piece_chars]


def decontaminate_shard(in_path: str, out_path: str, tasks_path: str, ignored_path: str, text_field: str,
                        cfg: DecontaminateConfig) -> dict:
    keys, owner, names = _load_tasks(tasks_path)
    active = ~np.isin(keys, np.load(ignored_path))
    keys, owner = keys[active], owner[active]
    ngrams = NgramKeys(cfg.ngram)
    records = read_shard(in_path)
    out, hits, dropped, pieces_made = [], [0] * len(names), 0, 0
    for record in records:
        hashes, spans = ngrams.words(record[text_field])
        k = ngrams.keys(hashes)
        pos = np.searchsorted(keys, k).clip(0, max(len(keys) - 1, 0))
        hit = (keys[pos] == k) if len(keys) else np.zeros(len(k), bool)
        if not hit.any():
            out.append(record)
            continue
        for t in owner[pos[hit]].tolist():
            hits[t] += 1
        pieces = cut(record[text_field], spans, np.flatnonzero(hit), cfg)
        if not pieces:
            dropped += 1
            continue
        pieces_made += len(pieces)
        for j, piece in enumerate(pieces):
            out.append({**record, "id": f"{record['id']}#{j}" if len(pieces) > 1 else record["id"], text_field: piece})
    write_shard(out_path, out)
    size = lambda rs: sum(len(r[text_field].encode("utf-8")) for r in rs)  # noqa: E731
    return {"docs_in": len(records), "docs_out": len(out), "bytes_in": size(records), "bytes_out": size(out),
            "dropped": {"contaminated": dropped} if dropped else {}, "pieces": pieces_made,
            "hits": dict(zip(names, hits))}
