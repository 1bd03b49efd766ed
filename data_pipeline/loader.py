"""Which samples each data-parallel rank reads, as a pure function of consumed samples.

The global order is the dataset's own (shuffled once, by the seed, when its indices are built),
so the loader keeps no random state: global batch ``b`` is the next ``global_batch`` samples after
``consumed``. It is served in micro-batch steps; at step ``m`` the data-parallel group reads the
``micro_batch * dp`` samples that follow, and rank ``r`` takes the ``r``-th ``micro_batch`` of them.
A run resumed at ``consumed = k`` therefore reads exactly what an uninterrupted run reads after
``k``, for any dp size, and a checkpoint need store only the one integer.

torch is imported only to build tensors; torch.distributed never is.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def micro_batch_indices(consumed: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int) -> list[np.ndarray]:
    """This rank's sample indices for the global batch that starts at ``consumed``, per micro-batch."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside a data-parallel group of {dp_size}")
    step = micro_batch * dp_size
    if micro_batch < 1 or global_batch % step:
        raise ValueError(f"global batch {global_batch} must be a positive multiple of micro batch x dp = "
                         f"{micro_batch} x {dp_size} = {step}")
    first = consumed + dp_rank * micro_batch
    return [np.arange(first + m * step, first + m * step + micro_batch) for m in range(global_batch // step)]


def to_batch(samples: list[np.ndarray]) -> dict:
    """Stack ``seq_len + 1``-token samples into ``tokens`` (inputs) and ``labels`` (next tokens).

    There is no loss mask: in packed pretraining samples every position is a real token whose
    successor is a real target, across document boundaries too (the EOD token separates them).
    """
    import torch

    stacked = torch.from_numpy(np.stack(samples).astype(np.int64, copy=False))
    return {"tokens": stacked[:, :-1].contiguous(), "labels": stacked[:, 1:].contiguous()}


def global_batch(dataset, consumed: int, global_batch_size: int, micro_batch: int, dp_rank: int,
                 dp_size: int) -> list[dict]:
    """This rank's micro-batches (as tensors) of the global batch starting at ``consumed``."""
    if consumed + global_batch_size > len(dataset):
        raise ValueError(f"the dataset holds {len(dataset)} samples but the global batch starting at "
                         f"{consumed} needs {consumed + global_batch_size}; build it for more samples "
                         "(train steps x global batch) or train for fewer steps")
    return [to_batch([dataset[int(i)] for i in idx])
            for idx in micro_batch_indices(consumed, global_batch_size, micro_batch, dp_rank, dp_size)]


def iterate_global_batches(dataset, consumed: int, global_batch_size: int, micro_batch: int, dp_rank: int,
                           dp_size: int) -> Iterator[tuple[int, list[dict]]]:
    """(consumed after the batch, its micro-batches) for every whole global batch left, from ``consumed``."""
    while consumed + global_batch_size <= len(dataset):
        batch = global_batch(dataset, consumed, global_batch_size, micro_batch, dp_rank, dp_size)
        consumed += global_batch_size
        yield consumed, batch
