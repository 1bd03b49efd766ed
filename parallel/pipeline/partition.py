"""Which transformer blocks each pipeline stage holds.

A split is a list with the number of blocks of each virtual stage (``pp * v`` entries, in virtual-
stage order). It comes from the user (``parallel.pipeline_split``) or is balanced by work: the last
stage also runs the LM head, which at 1.3B costs as much as 1.75 blocks (2·h·V against a block's
matrices), so an equal split leaves the first rank idle for that long in every micro-batch of a
1F1B or zero-bubble steady state. The caller states the head's cost in blocks (``head_cost``); the
embedding's lookup costs next to nothing and is not counted. With ``head_cost = 0`` the balanced
split is the even one: remainders on the middle ranks, and within a rank on its first chunks.
"""

from __future__ import annotations

import functools
import heapq
from typing import Optional, Sequence


def balanced_split(num_layers: int, pp: int, v: int = 1, head_cost: float = 0.0) -> list[int]:
    """Blocks per virtual stage such that no pipeline rank's work (its blocks, plus ``head_cost`` on
    the last rank) is larger than whole blocks force it to be; then each rank's blocks spread over its
    ``v`` chunks the same way (the head sits in the last rank's last chunk)."""
    return list(_balanced_split(num_layers, pp, v, float(head_cost)))


@functools.lru_cache(maxsize=256)
def _balanced_split(num_layers: int, pp: int, v: int, head_cost: float) -> tuple[int, ...]:
    """``balanced_split``, remembered: the engine, the planner's every rank of every candidate layout
    and the checkpoint's layout record all ask for the same few splits."""
    if pp < 1 or v < 1:
        raise ValueError(f"need at least one pipeline stage, got pp {pp} x virtual stages {v}")
    problem = split_problem(num_layers, pp, v)
    if problem:
        raise ValueError(problem)
    per_rank = _fill(num_layers, [head_cost if r == pp - 1 else 0.0 for r in range(pp)], minimum=v)
    split = [0] * (pp * v)
    for rank, blocks in enumerate(per_rank):
        head = head_cost if rank == pp - 1 else 0.0
        for chunk, count in enumerate(_fill(blocks, [head if c == v - 1 else 0.0 for c in range(v)], minimum=1)):
            split[chunk * pp + rank] = count
    return tuple(split)


def _fill(count: int, extra: Sequence[float], minimum: int) -> list[int]:
    """``count`` blocks over ``len(extra)`` bins of at least ``minimum`` each, every next block to the
    bin with the least work (its blocks plus its ``extra``): for blocks of equal cost this keeps the
    largest bin as small as possible. Ties go to the middle bins, then the lower index."""
    bins = [minimum] * len(extra)
    ends = (0, len(extra) - 1)
    lightest = [(minimum + e, b in ends, b) for b, e in enumerate(extra)]
    heapq.heapify(lightest)
    for _ in range(count - minimum * len(extra)):
        _, end, b = heapq.heappop(lightest)
        bins[b] += 1
        heapq.heappush(lightest, (bins[b] + extra[b], end, b))
    return bins


def split_problem(num_layers: int, pp: int, v: int = 1, split: Optional[Sequence[int]] = None) -> Optional[str]:
    """Why a run's split cannot work, in config terms, or None: a given split must list ``pp * v``
    positive block counts summing to ``num_layers``; without one, every virtual stage needs a block.
    Config validation reports this before launch; ``resolve_split`` refuses a bad split."""
    stages = pp * v
    if split is not None:
        split = list(split)
        if len(split) != stages or any(not isinstance(k, int) or k < 1 for k in split) or sum(split) != num_layers:
            return (f"parallel.pipeline_split: {split} must be {stages} positive layer counts "
                    f"(pp*virtual_stages = {pp}*{v}) summing to model.num_layers {num_layers}")
    elif num_layers < stages:
        return (f"model.num_layers: {num_layers} blocks cannot fill parallel.pp*parallel.virtual_stages = {stages} "
                f"pipeline stages (every stage needs one); lower pp or virtual_stages, or add layers")
    return None


def resolve_split(num_layers: int, pp: int, v: int = 1, split: Optional[Sequence[int]] = None,
                  head_cost: float = 0.0) -> list[int]:
    """The user's split if given (validated), else ``balanced_split`` with the head's cost in blocks."""
    problem = split_problem(num_layers, pp, v, split)
    if problem:
        raise ValueError(problem)
    return list(split) if split is not None else balanced_split(num_layers, pp, v, head_cost)


def stage_layers(split: Sequence[int], pp: int, rank: int, chunk: int = 0) -> range:
    """Global block indices held by chunk ``chunk`` of pipeline rank ``rank`` (virtual stage chunk*pp + rank)."""
    stage = chunk * pp + rank
    if not 0 <= stage < len(split):
        raise ValueError(f"virtual stage {stage} (rank {rank}, chunk {chunk}) is outside a {len(split)}-stage split")
    start = sum(split[:stage])
    return range(start, start + split[stage])

