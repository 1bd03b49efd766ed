"""Layout-independent weight initialisation: the same full model for every tp (and pp) split.

Each logical weight is drawn row by row, and row ``i`` of the weight named ``key`` comes from a
generator seeded with a hash of ``(seed, key, i)``. A rank holding rows ``[a, b)`` (a column-parallel
or vocab-parallel shard) draws only those rows; a rank holding a column slice (row-parallel) draws
each full row and keeps its slice, so it never holds more than one full row it does not own. No
rank ever materialises a full weight matrix, which is what lets a model built on the meta device
be initialised shard by shard, and the values do not depend on tp, on which pipeline stage owns a
layer (keys are global parameter names), or on the device.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import torch

from parallel.tensor_parallel.sharding import Shard

_ROW_BITS = 23  # rows per weight < 8M (vocabularies, widths, sequence lengths all fit)
MAX_ROWS = 1 << _ROW_BITS  # the rows a weight may have: the config's checks hold the vocabulary and positions to it


def _row_seed(base: int, row: int) -> int:
    return (base << _ROW_BITS) | row


def seeded_normal(full_shape: tuple[int, int], std: float, seed: int, key: str,
                  shard: Optional[Shard] = None, zero_rows_from: Optional[int] = None) -> torch.Tensor:
    """This rank's part (fp32, CPU) of a normal(0, std) matrix of ``full_shape`` named ``key``.

    Rows at or past ``zero_rows_from`` are zero (the padding rows of a vocabulary).
    """
    rows, cols = full_shape
    if rows >= MAX_ROWS:
        raise ValueError(f"{key}: {rows} rows exceed the {MAX_ROWS} the seeded initialisation supports")
    base = int.from_bytes(hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=5).digest(), "little")
    row_range, col_slice = range(rows), slice(None)
    if shard is not None and shard.dim == 0:
        per = rows // shard.count
        row_range = range(shard.index * per, (shard.index + 1) * per)
    elif shard is not None:
        per = cols // shard.count
        col_slice = slice(shard.index * per, (shard.index + 1) * per)
    out = torch.zeros(len(row_range), len(range(cols)[col_slice]))
    generator = torch.Generator()
    for local, row in enumerate(row_range):
        if zero_rows_from is not None and row >= zero_rows_from:
            break
        generator.manual_seed(_row_seed(base, row))
        out[local] = torch.randn(cols, generator=generator)[col_slice]
    return out.mul_(std)
