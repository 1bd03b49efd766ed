"""Files of rows grouped by hash partition, each partition read back with a handful of small reads.

Dedup sub-stages hand data over all-to-all: a per-shard task writes its rows grouped by partition,
and each per-partition task then reads its slice of every shard's file, so a stage makes
shards x partitions reads. Each must be cheap: one ``open`` and a few ``pread`` calls, no memory
map and no header to parse per column (three ``np.load`` calls per read cost about 0.3 ms, which at
160 shards and 160 partitions was most of the bucket sub-stage's time).

One file holds one or more columns (1-D arrays of the same length) with their rows sorted by
partition, stable within a partition:

    magic (8 bytes) | parts, columns (int64) | each column's dtype, 8 ASCII bytes |
    parts + 1 row offsets (int64) | column 0's rows | column 1's rows | ...

A file that does not start with the magic (an intermediate file from another version, or another
file) is refused with its name, as is a file shorter than its header says.
"""

from __future__ import annotations

import itertools
import os
from typing import Sequence

import numpy as np

from data_pipeline.curate.shards import atomic_write_bytes

MAGIC = b"MZPART1\n"
_FIRST_READ = 1 << 16  # the header of up to about 8,000 partitions comes in one read


def save(path: str, partition_of_row: np.ndarray, columns: Sequence[np.ndarray], parts: int) -> None:
    """Write ``columns`` with their rows grouped by ``partition_of_row`` (values in [0, parts)); to a
    temporary name, then renamed, so a killed task leaves no half-written file."""
    partition_of_row = np.asarray(partition_of_row).astype(np.int64)
    order = np.argsort(partition_of_row, kind="stable")
    offsets = np.searchsorted(partition_of_row[order], np.arange(parts + 1)).astype(np.int64)
    dtypes = b"".join(np.dtype(c.dtype).str.encode("ascii").ljust(8) for c in columns)
    header = MAGIC + np.array([parts, len(columns)], np.int64).tobytes() + dtypes + offsets.tobytes()
    atomic_write_bytes(path, itertools.chain([header], (np.asarray(c)[order].tobytes() for c in columns)))


def _read(fd: int, size: int, offset: int, path: str) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise ValueError(f"{path}: truncated (wanted {size} bytes at {offset}, got {len(data)}); delete the "
                         "stage's folder and run it again")
    return data


def load(path: str, part: int) -> list[np.ndarray]:
    """Every column's rows of partition ``part``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        head = os.pread(fd, _FIRST_READ, 0)
        if head[:8] != MAGIC or len(head) < 24:
            raise ValueError(f"{path}: not a partitioned file of this version; delete the stage's folder "
                             "and run it again")
        parts, ncols = np.frombuffer(head[8:24], np.int64).tolist()
        if not 0 <= part < parts:
            raise ValueError(f"{path}: partition {part} of a file with {parts}")
        header = 24 + 8 * ncols + 8 * (parts + 1)
        if len(head) < header:
            head = _read(fd, header, 0, path)
        dtypes = [np.dtype(head[24 + 8 * i:32 + 8 * i].decode("ascii").strip()) for i in range(ncols)]
        offsets = np.frombuffer(head[24 + 8 * ncols:header], np.int64)
        lo, hi, rows = int(offsets[part]), int(offsets[part + 1]), int(offsets[-1])
        out, start = [], header
        for dtype in dtypes:
            out.append(np.frombuffer(_read(fd, (hi - lo) * dtype.itemsize, start + lo * dtype.itemsize, path), dtype))
            start += rows * dtype.itemsize
        return out
    finally:
        os.close(fd)
