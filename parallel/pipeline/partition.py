"""Which transformer blocks each pipeline stage holds.

A split is a list with the number of blocks of each virtual stage (``pp * v`` entries, in virtual-
stage order). An entry may end in a half: ``[12.5, 11.5]`` cuts block 12 between its attention,
which the first stage runs, and its MLP, which the second does (the hidden state between them is
the residual sum after the attention). Whole blocks can leave the busiest stage well above the mean
where stages hold few blocks (GPT 1.3B at pp 4: 7 block-equivalents against 6.4; GPT 6.7B at pp 2,
whose head costs about one block: 16.9 against 16.5); a half block is the finer step. The halves are
not equal: the MLP does 57% of a GPT 1.3B block's matrix work.

The split comes from the user (``parallel.pipeline_split``) or is balanced by work in whole blocks:
the last stage also runs the LM head, which at 1.3B costs as much as 1.75 blocks (2·h·V against a
block's matrices), so an equal split leaves the first rank idle for that long in every micro-batch
of a 1F1B or zero-bubble steady state. The caller states the head's cost in blocks (``head_cost``);
the embedding's lookup costs next to nothing and is not counted. With ``head_cost = 0`` the balanced
split is the even one: remainders on the middle ranks, and within a rank on its first chunks.
"""

from __future__ import annotations

import functools
import heapq
from typing import Optional, Sequence

BLOCK_PARTS = ("attention", "mlp")
"""The two halves of a transformer block, in order, that a split may put on different stages."""


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


def _halves(count) -> Optional[int]:
    """A split entry in half blocks (12.5 -> 25), or None when it is not a positive multiple of 0.5."""
    if isinstance(count, bool) or not isinstance(count, (int, float)) or count <= 0 or (2 * count) % 1:
        return None
    return int(2 * count)


def split_problem(num_layers: int, pp: int, v: int = 1, split: Optional[Sequence[float]] = None) -> Optional[str]:
    """Why a run's split cannot work, in config terms, or None: a given split must list ``pp * v``
    positive block counts, whole or ending in a half, summing to ``num_layers``; without one, every
    virtual stage needs a block. Config validation reports this before launch; ``resolve_split``
    refuses a bad split."""
    stages = pp * v
    if split is not None:
        split = list(split)
        halves = [_halves(k) for k in split]
        if len(split) != stages or None in halves or sum(halves) != 2 * num_layers:
            return (f"parallel.pipeline_split: {split} must be {stages} positive layer counts, whole or "
                    f"halves such as 12.5 (pp*virtual_stages = {pp}*{v}), summing to model.num_layers {num_layers}")
    elif num_layers < stages:
        return (f"model.num_layers: {num_layers} blocks cannot fill parallel.pp*parallel.virtual_stages = {stages} "
                f"pipeline stages (every stage needs one); lower pp or virtual_stages, or add layers")
    return None


def resolve_split(num_layers: int, pp: int, v: int = 1, split: Optional[Sequence[float]] = None,
                  head_cost: float = 0.0) -> list[float]:
    """The user's split if given (validated), else ``balanced_split`` with the head's cost in blocks."""
    problem = split_problem(num_layers, pp, v, split)
    if problem:
        raise ValueError(problem)
    return list(split) if split is not None else balanced_split(num_layers, pp, v, head_cost)


def _stage_halves(split: Sequence[float], pp: int, rank: int, chunk: int) -> tuple[int, int]:
    """The half blocks [start, end) of chunk ``chunk`` of pipeline rank ``rank``: half 2i is block i's
    attention, half 2i + 1 its MLP."""
    stage = chunk * pp + rank
    if not 0 <= stage < len(split):
        raise ValueError(f"virtual stage {stage} (rank {rank}, chunk {chunk}) is outside a {len(split)}-stage split")
    halves = [_halves(k) for k in split]
    if None in halves:
        raise ValueError(f"pipeline split {list(split)}: every entry must be a positive multiple of 0.5")
    start = sum(halves[:stage])
    return start, start + halves[stage]


def stage_layers(split: Sequence[float], pp: int, rank: int, chunk: int = 0) -> range:
    """Global indices of the blocks chunk ``chunk`` of pipeline rank ``rank`` (virtual stage
    chunk*pp + rank) holds, whole or in part (see ``stage_parts``)."""
    start, end = _stage_halves(split, pp, rank, chunk)
    return range(start // 2, (end + 1) // 2)


def stage_parts(split: Sequence[float], pp: int, rank: int, chunk: int = 0) -> dict[int, tuple[str, ...]]:
    """The blocks of that chunk it holds only in part, each with the part it holds: ``("mlp",)`` for a
    block whose attention the previous stage ran, ``("attention",)`` for one whose MLP the next stage
    runs. Empty for a split of whole blocks."""
    start, end = _stage_halves(split, pp, rank, chunk)
    attention, mlp = BLOCK_PARTS
    parts = {}
    if start % 2:
        parts[start // 2] = (mlp,)
    if end % 2:
        parts[end // 2] = (attention,)
    return parts
