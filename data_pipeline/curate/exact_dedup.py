"""``exact-dedup``: drop every document whose normalised text appeared earlier in document order.

Three sub-stages exchange files so that no process holds more than about one shard's worth:
``hashes`` (per shard: a 64-bit hash of each document's lower-cased, space-collapsed text, grouped
by hash partition),
``duplicates`` (per hash partition: every occurrence after the first, as a global document number),
``filter`` (per shard: the shard without its duplicates). A global document number is
``shard index << 32 | row``, so sorting by it is document order.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass

import numpy as np

from data_pipeline.curate import partitioned
from data_pipeline.curate.shards import read_shard, write_shard

_SPACE = re.compile(r"\s+")
ROW_BITS = 32


@dataclass
class ExactDedupConfig:
    """No options: a dataclass all the same, so that a key under ``exact_dedup`` is refused as unknown."""

    def problems(self) -> list[str]:
        return []


def text_hash(text: str) -> int:
    normalised = _SPACE.sub(" ", text.lower()).strip()
    return int.from_bytes(hashlib.blake2b(normalised.encode("utf-8"), digest_size=8).digest(), "little")


def hash_shard(in_path: str, out_prefix: str, text_field: str, parts: int) -> dict:
    hashes = np.fromiter((text_hash(r[text_field]) for r in read_shard(in_path)), dtype=np.uint64)
    save_keyed(out_prefix, hashes, np.arange(len(hashes), dtype=np.int64), parts)
    return {"docs": len(hashes)}


def save_keyed(prefix: str, keys: np.ndarray, rows: np.ndarray, parts: int) -> None:
    """Keys and their rows grouped by partition (key % parts) in PREFIX.part, so that a partition's
    task reads its slice of every shard and nothing else (rows keep their order within a slice)."""
    partitioned.save(f"{prefix}.part", keys % np.uint64(parts), [keys, rows], parts)


def load_keyed(prefix: str, part: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys, rows) of one partition of one shard."""
    keys, rows = partitioned.load(f"{prefix}.part", part)
    return keys, rows


def save_array(path: str, array: np.ndarray) -> None:
    """np.save to a temporary name, then rename: a killed task leaves no half-written array."""
    tmp = f"{path}.tmp-{os.getpid()}.npy"
    np.save(tmp, array)
    os.replace(tmp, path)


def duplicates_in_partition(prefixes: list[str], part: int, out_path: str) -> dict:
    """Global numbers of the documents, in this hash partition, whose hash occurred before."""
    keys, gids = [], []
    for shard, prefix in enumerate(prefixes):
        hashes, rows = load_keyed(prefix, part)
        keys.append(hashes)
        gids.append((np.int64(shard) << ROW_BITS) | rows)
    keys, gids = np.concatenate(keys), np.concatenate(gids)  # gids ascend: document order
    _, first = np.unique(keys, return_index=True)  # index of each hash's first occurrence
    duplicate = np.ones(len(keys), dtype=bool)
    duplicate[first] = False
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
    write_shard(out_path, kept)
    size = lambda rs: sum(len(r[text_field].encode("utf-8")) for r in rs)  # noqa: E731
    return {"docs_in": len(records), "docs_out": len(kept), "bytes_in": size(records), "bytes_out": size(kept),
            "dropped": {reason: len(records) - len(kept)} if drop else {}}
