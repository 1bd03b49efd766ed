"""The partitioned files that dedup's sub-stages exchange: every partition reads back exactly its
rows, in their original order, for any number of partitions and columns; anything else is refused
with the file's name."""

from __future__ import annotations

import numpy as np
import pytest

from data_pipeline.curate import partitioned


@pytest.mark.parametrize("parts", [1, 7, 10_000])  # 10,000: a header longer than the first read
def test_every_partition_reads_back_its_rows_in_order(tmp_path, parts):
    rng = np.random.default_rng(parts)
    n = 5_000
    keys = rng.integers(0, 2**63, n, dtype=np.uint64)
    rows = np.arange(n, dtype=np.int64)
    small = rng.integers(0, 2**31, n).astype(np.uint32)
    which = (keys % np.uint64(parts)).astype(np.int64)
    path = str(tmp_path / "x.part")
    partitioned.save(path, which, [keys, small, rows], parts)  # a 4-byte column between 8-byte ones
    seen = 0
    for p in range(parts):
        got_keys, got_small, got_rows = partitioned.load(path, p)
        mine = np.flatnonzero(which == p)  # stable: original order within the partition
        assert got_keys.dtype == np.uint64 and got_rows.dtype == np.int64 and got_small.dtype == np.uint32
        assert np.array_equal(got_keys, keys[mine]) and np.array_equal(got_rows, rows[mine])
        assert np.array_equal(got_small, small[mine])
        seen += len(got_rows)
    assert seen == n


def test_empty_file_has_empty_partitions(tmp_path):
    path = str(tmp_path / "empty.part")
    partitioned.save(path, np.zeros(0, np.int64), [np.zeros(0, np.uint64)], 4)
    assert [len(partitioned.load(path, p)[0]) for p in range(4)] == [0, 0, 0, 0]


def test_a_foreign_truncated_or_misaddressed_file_is_refused_by_name(tmp_path):
    path = str(tmp_path / "x.part")
    partitioned.save(path, np.arange(100) % 3, [np.arange(100, dtype=np.int64)], 3)
    with pytest.raises(ValueError, match="partition 3 of a file with 3"):
        partitioned.load(path, 3)
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-8])  # the last row cut off
    with pytest.raises(ValueError, match=r"x\.part: truncated"):
        partitioned.load(path, 2)
    np.save(str(tmp_path / "old.npy"), np.arange(10))  # an intermediate file of the earlier format
    with pytest.raises(ValueError, match=r"old\.npy: not a partitioned file"):
        partitioned.load(str(tmp_path / "old.npy"), 0)
