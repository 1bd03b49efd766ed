"""``exact-dedup``: drop every document whose normalised text appeared earlier in document order.

Three sub-stages exchange files so that no process holds more than about one shard's worth:
``hashes`` (per shard: a 128-bit hash of each document's lower-cased, space-collapsed text, grouped
by hash partition),
``duplicates`` (per hash partition: every occurrence after the first, as a global document number),
``filter`` (per shard: the shard without its duplicates). A global document number is
``shard index << 32 | row``, so sorting by it is document order.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from data_pipeline.curate import partitioned
from data_pipeline.curate.shards import read_shard, write_shard
from data_pipeline.curate.text_forms import composed
from data_pipeline.paths import written_whole

_SPACE = re.compile(r"\s+")
ROW_BITS = 32


@dataclass
class ExactDedupConfig:
    """No options: a dataclass all the same, so that a key under ``exact_dedup`` is refused as unknown."""

    def problems(self) -> list[str]:
        return []


def text_hash(text: str) -> bytes:
    """128 bits of BLAKE2b of the normalised text: composed (NFC), lower-cased, runs of white space one
    space. Why not 64: two different documents sharing a hash lose the later one silently, and among
    n documents some pair does with probability about n^2 / 2^(bits + 1): 3% at a billion documents
    with 64 bits, 1e-18 with 128."""
    normalised = _SPACE.sub(" ", composed(text).lower()).strip()
    return hashlib.blake2b(normalised.encode("utf-8"), digest_size=16).digest()


def hash_shard(in_path: str, out_prefix: str, text_field: str, parts: int) -> dict:
    digests = b"".join(text_hash(r[text_field]) for r in read_shard(in_path))
    halves = np.frombuffer(digests, dtype="<u8").reshape(-1, 2)
    low, high = halves[:, 0].copy(), halves[:, 1].copy()
    save_keyed(out_prefix, [low, high], np.arange(len(halves), dtype=np.int64), parts)
    return {"docs": len(halves)}


def save_keyed(prefix: str, keys: Sequence[np.ndarray], rows: np.ndarray, parts: int) -> None:
    """Key columns and their rows grouped by partition (the first key column % parts) in PREFIX.part,
    so that a partition's task reads its slice of every shard and nothing else (rows keep their order
    within a slice)."""
    partitioned.save(f"{prefix}.part", keys[0] % np.uint64(parts), [*keys, rows], parts)


def load_keyed(prefix: str, part: int, key_columns: int = 1) -> tuple[list[np.ndarray], np.ndarray]:
    """(key columns, rows) of one partition of one shard; a file with another number of key columns
    (written by another version of the stage) is refused."""
    *keys, rows = partitioned.load(f"{prefix}.part", part)
    if len(keys) != key_columns:
        raise ValueError(f"{prefix}.part: {len(keys)} key columns where this version writes {key_columns}; "
                         "delete the stage's folder and run it again")
    return keys, rows


def save_array(path: str, array: np.ndarray) -> None:
    """np.save to a temporary name, then rename: a killed task leaves no half-written array."""
    with written_whole(path, ".npy") as tmp:
        np.save(tmp, array)


def duplicates_in_partition(prefixes: list[str], part: int, out_path: str) -> dict:
    """Global numbers of the documents, in this hash partition, whose hash occurred before."""
    lows, highs, gids = [], [], []
    for shard, prefix in enumerate(prefixes):
        (low, high), rows = load_keyed(prefix, part, key_columns=2)
        lows.append(low)
        highs.append(high)
        gids.append((np.int64(shard) << ROW_BITS) | rows)
    low, high, gids = np.concatenate(lows), np.concatenate(highs), np.concatenate(gids)  # gids: document order
    order = np.lexsort((low, high))  # stable: each hash's occurrences stay in document order
    repeat = (low[order][1:] == low[order][:-1]) & (high[order][1:] == high[order][:-1])
    duplicate = np.zeros(len(gids), dtype=bool)
    duplicate[order[1:][repeat]] = True
    save_drops(out_path, gids[duplicate], len(prefixes))
    return {"duplicates": int(duplicate.sum())}


def save_drops(path: str, gids: np.ndarray, shards: int) -> None:
    """Documents to drop (global numbers), grouped by shard, for each shard's filter task to read its
    own rows of (``partitioned``)."""
    gids = np.sort(np.asarray(gids, dtype=np.int64))
    partitioned.save(path, gids >> ROW_BITS, [gids & ((1 << ROW_BITS) - 1)], max(1, shards))


def rows_to_drop(drop_paths: list[str], shard: int) -> np.ndarray:
    """Rows of ``shard`` listed in any of the drop files (``save_drops``)."""
    rows = [partitioned.load(path, shard)[0] for path in drop_paths]
    return np.unique(np.concatenate(rows)) if rows else np.zeros(0, dtype=np.int64)


def filter_shard(in_path: str, out_path: str, text_field: str, drop_paths: list[str], shard: int,
                 reason: str) -> dict:
    records = read_shard(in_path)
    drop = set(rows_to_drop(drop_paths, shard).tolist())
    kept = [r for i, r in enumerate(records) if i not in drop]
    write_shard(out_path, kept, like=in_path)
    size = lambda rs: sum(len(r[text_field].encode("utf-8")) for r in rs)  # noqa: E731
    return {"docs_in": len(records), "docs_out": len(kept), "bytes_in": size(records), "bytes_out": size(kept),
            "dropped": {reason: len(records) - len(kept)} if drop else {}}
