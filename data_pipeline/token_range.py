"""The largest token id in a shard, for checking it against a model's vocabulary before a run."""

from __future__ import annotations

import os

import numpy as np

from data_pipeline.index_cache import cached_arrays, default_cache_dir
from data_pipeline.indexed import IndexedDataset
from data_pipeline.shard_files import bin_path

SCAN_CHUNK_BYTES = 64 << 20  # largest_token_id reads the .bin this much at a time


def largest_token_id(prefix: str, cache_dir: str | None = None) -> int:
    """The largest token id in shard ``prefix``, or -1 if it holds no tokens; a model's vocabulary
    must exceed it.

    The ``.bin`` is read SCAN_CHUNK_BYTES at a time into one reusable buffer, so memory stays
    bounded for any shard (a scan through the memory map would leave the whole shard resident in
    this process, which job schedulers count against it). The answer is cached in ``cache_dir``
    (default: ``index-cache`` beside the shard, as for the sample indices) under the ``.idx``
    fingerprint and the ``.bin``'s size, modification and change times (an edit can set the first
    back, never the second), so a second start reads one small file instead of the whole shard. A
    negative id or a shard of float values raises ValueError naming the ``.bin``.
    """
    data = IndexedDataset(prefix)
    binf = bin_path(prefix)
    stat = os.stat(binf)
    description = {"idx_sha256": data.fingerprint, "bin_bytes": stat.st_size, "bin_mtime_ns": stat.st_mtime_ns,
                   "bin_ctime_ns": stat.st_ctime_ns}
    arrays = cached_arrays(cache_dir or default_cache_dir(prefix), "largest-token", description, ("largest",),
                           lambda: {"largest": np.array([_scan_largest(data, binf)], dtype=np.int64)})
    return int(arrays["largest"][0])


def _scan_largest(data: IndexedDataset, binf: str) -> int:
    dtype = data.dtype
    if dtype.kind not in "iu":
        raise ValueError(f"{binf}: holds {dtype} values, not integer token ids")
    buf = np.empty(max(SCAN_CHUNK_BYTES // dtype.itemsize, 1), dtype)
    largest, start = -1, 0
    with open(binf, "rb") as f:
        while count := f.readinto(buf) // dtype.itemsize:
            chunk = buf[:count]
            if dtype.kind == "i" and chunk.min() < 0:
                at = int(np.argmax(chunk < 0))
                raise ValueError(f"{binf}: token {start + at} is {int(chunk[at])}, a negative id; the shard is corrupt")
            largest = max(largest, int(chunk.max()))
            start += count
    return largest
