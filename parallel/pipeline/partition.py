"""Which transformer blocks each pipeline stage holds.

A split is a list with the number of blocks of each virtual stage (``pp * v`` entries, in virtual-
stage order). An entry may end in a half: ``[12.5, 11.5]`` cuts block 12 between its attention,
which the first stage runs, and its MLP, which the second does (the hidden state between them is
the residual sum after the attention). Whole blocks can leave the busiest stage well above the mean
where stages hold few blocks (GPT 1.3B at pp 4: 7 block-equivalents against 6.4; GPT 6.7B at pp 2,
whose head costs about one block: 16.9 against 16.5); a half block is the finer step. The halves are
not equal: the MLP does 57% of a GPT 1.3B block's work.

The split comes from the user (``parallel.pipeline_split``) or is balanced by work: the last stage
also runs the LM head, which at 1.3B costs as much as 1.75 blocks (2·h·V against a block's
matrices), so an equal split leaves the first rank idle for that long in every micro-batch of a 1F1B
or zero-bubble steady state. The caller states the head's cost in blocks (``head_cost``); the
embedding's lookup costs next to nothing and is not counted. In whole blocks with ``head_cost = 0``
the balanced split is the even one: remainders on the middle ranks, and within a rank on its first
chunks. Given the attention half's share of a block (``attention_share``), the split may cut blocks
in half: with one chunk a rank where that lowers the busiest rank's work by more than
``HALF_BLOCK_GAIN``; with several, where it lowers the busiest chunk's work by that much without
adding to the busiest rank's. An interleaved schedule hands each micro-batch from chunk to chunk, so
its slowest chunk paces every hand-over, not only the rank's total (GPT 1.3B at pp 2 with two chunks
a rank: whole blocks make the chunks 7, 6, 6 and 6.75 blocks' work; halves make them 6.3-6.6, and
ran 2.0-3.7% faster under ``interleaved_zb`` and 1.6% under interleaved 1F1B, BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from typing import Optional, Sequence

from parallel.pipeline.placement import stage_of

BLOCK_PARTS = ("attention", "mlp")
"""The two halves of a transformer block, in order, that a split may put on different stages."""


HALF_BLOCK_GAIN = 0.01
"""How much less work the busiest rank must get before the balanced split cuts a block in half: the
time model's error where it was measured (pp 2, GPT 1.3B: a half split predicted 2.5% slower ran 3.6%
slower), so a smaller predicted gain is not one."""


def balanced_split(num_layers: int, pp: int, v: int = 1, head_cost: float = 0.0,
                   attention_share: Optional[float] = None) -> list[float]:
    """Blocks per virtual stage such that no pipeline rank's work (its blocks, plus ``head_cost`` on
    the last rank) is larger than whole blocks force it to be; then each rank's blocks spread over its
    ``v`` chunks the same way (the head sits in the last rank's last chunk). With ``attention_share``,
    counts may end in a half (``_half_block_split`` over every virtual stage) where the module
    docstring's gains allow."""
    if attention_share is not None and not 0 < attention_share < 1:
        raise ValueError(f"attention_share must lie strictly between 0 and 1, got {attention_share}")
    if not 0 <= head_cost < math.inf:
        raise ValueError(f"head_cost must be a finite number of blocks, at least 0, got {head_cost}")
    return list(_balanced_split(num_layers, pp, v, float(head_cost), attention_share))


@functools.lru_cache(maxsize=256)
def _balanced_split(num_layers: int, pp: int, v: int, head_cost: float,
                    attention_share: Optional[float]) -> tuple[float, ...]:
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
    if attention_share is None:
        return tuple(split)
    halves, _ = _half_block_split(num_layers, pp * v, head_cost, attention_share)
    cut = tuple(k // 2 if k % 2 == 0 else k / 2 for k in halves)
    whole, halved = (_stage_works(counts, pp, head_cost, attention_share) for counts in (split, cut))

    def busiest_rank(works: list[float]) -> float:  # with one chunk a rank, the busiest stage
        return max(sum(works[rank::pp]) for rank in range(pp))

    gains = max(halved) < max(whole) * (1 - HALF_BLOCK_GAIN) - 1e-9  # a gain at the limit, in rounding, is none
    return cut if gains and busiest_rank(halved) <= busiest_rank(whole) + 1e-9 else tuple(split)


def _stage_works(split: Sequence[float], pp: int, head_cost: float, share: float) -> list[float]:
    """Each virtual stage's work in blocks, in virtual-stage order, the head on the last."""
    works = [halves_work(*_stage_halves(split, pp, stage % pp, stage // pp), share) for stage in range(len(split))]
    works[-1] += head_cost
    return works


def _half_block_split(num_layers: int, pp: int, head_cost: float, share: float) -> tuple[list[int], float]:
    """The split in half blocks (attention halves weigh ``share``, MLP halves the rest) whose busiest
    rank has the least work, and that work. The least feasible limit is found by bisection over the
    works a contiguous run of halves can have (k whole blocks, plus nothing, one attention or one MLP
    half, plus the head or not). Under it, each stage from the last takes the count nearest an even
    share of the work left (whole blocks on ties) that keeps the earlier stages packable. Evenness
    comes before fewer cuts: a cut costs only an unfused residual add and norm (one activation's
    extra reads and writes), while slack gathered on the first stage, which holds the most
    micro-batches in flight, costs memory."""
    halves = 2 * num_layers
    limits = sorted({k + part + head for k in range(num_layers + 1) for part in (0.0, share, 1.0 - share)
                     for head in (0.0, head_cost)})

    def packable(end: int, stages: int, limit: float, head: float) -> bool:
        """Whether halves [0, end) fill ``stages`` stages of at least one half each within ``limit``
        (the last of them also running ``head``): fill each from the back as far as the limit allows."""
        for stage in range(stages - 1, 0, -1):
            start = end - 1
            while start > stage and halves_work(start - 1, end, share) + head <= limit + 1e-9:
                start -= 1
            if halves_work(start, end, share) + head > limit + 1e-9:
                return False
            end, head = start, 0.0
        return halves_work(0, end, share) + head <= limit + 1e-9

    lo, hi = 0, len(limits) - 1  # the largest limit, every block and the head on one stage, is feasible
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if packable(halves, pp, limits[mid], head_cost) else (mid + 1, hi)
    limit = limits[lo]
    counts, end, head = [0] * pp, halves, head_cost
    for stage in range(pp - 1, 0, -1):
        target = (halves_work(0, end, share) + head) / (stage + 1)
        options = [start for start in range(end - 1, stage - 1, -1)
                   if halves_work(start, end, share) + head <= limit + 1e-9 and packable(start, stage, limit, 0.0)]
        start = min(options, key=lambda s: (round(abs(halves_work(s, end, share) + head - target), 9), s % 2))
        counts[stage], end, head = end - start, start, 0.0
    counts[0] = end
    return counts, limit


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
                  head_cost: float = 0.0, attention_share: Optional[float] = None,
                  placement: str = "loop") -> list[float]:
    """The user's split if given (validated), else ``balanced_split`` with the head's cost in blocks
    and the attention half's share of a block (``balanced_v_split`` for a V ``placement``)."""
    problem = split_problem(num_layers, pp, v, split)
    if problem:
        raise ValueError(problem)
    if split is not None:
        return list(split)
    if placement == "v":
        return balanced_v_split(num_layers, pp, head_cost)
    return balanced_split(num_layers, pp, v, head_cost, attention_share)


def balanced_v_split(num_layers: int, pp: int, head_cost: float = 0.0) -> list[float]:
    """Whole blocks per virtual stage of a V (two chunks a rank, ``placement``): each rank's blocks as
    ``_fill`` balances them with the head on the first rank, halved between its chunks with the odd
    block on the second. The first chunk is the one every other rank waits for at the start of a step
    (on the first rank) or that paces the way down, so it gets the smaller half: GPT 1.3B at pp 2
    comes out [5, 6, 7, 6], 3 ms a step shorter than [6, 6, 7, 5] when ``plan.timeline`` times them
    with the op costs measured on H200s (1017 against 1020 ms)."""
    if pp < 2 or num_layers < 2 * pp:
        raise ValueError(f"a V of {pp} pipeline ranks needs at least {2 * pp} blocks, got {num_layers}")
    split = [0] * (2 * pp)
    for rank, blocks in enumerate(_fill(num_layers, [head_cost if r == 0 else 0.0 for r in range(pp)], minimum=2)):
        split[stage_of(pp, rank, 0, "v")] = blocks // 2
        split[stage_of(pp, rank, 1, "v")] = blocks - blocks // 2
    return split


def _stage_halves(split: Sequence[float], pp: int, rank: int, chunk: int, placement: str = "loop") -> tuple[int, int]:
    """The half blocks [start, end) of chunk ``chunk`` of pipeline rank ``rank``: half 2i is block i's
    attention, half 2i + 1 its MLP."""
    stage = stage_of(pp, rank, chunk, placement)
    if not 0 <= stage < len(split):
        raise ValueError(f"virtual stage {stage} (rank {rank}, chunk {chunk}) is outside a {len(split)}-stage split")
    bounds = _half_bounds(tuple(split))
    return bounds[stage], bounds[stage + 1]


@functools.lru_cache(maxsize=1024)
def _half_bounds(split: tuple) -> tuple[int, ...]:
    """Where each stage of ``split`` starts, in half blocks, and where the last ends: worked out once
    per split, as the planner asks for every rank's stages of thousands of layouts."""
    halves = [_halves(k) for k in split]
    if None in halves:
        raise ValueError(f"pipeline split {list(split)}: every entry must be a positive multiple of 0.5")
    return tuple(itertools.accumulate(halves, initial=0))


def halves_work(start: int, end: int, attention_share: float) -> float:
    """Blocks' worth of work in the half blocks [start, end): attention halves (even indices) weigh
    ``attention_share``, MLP halves the rest."""
    attention = (end + 1) // 2 - (start + 1) // 2
    return attention * attention_share + (end - start - attention) * (1.0 - attention_share)


def rank_work(split: Sequence[float], pp: int, rank: int, attention_share: float, placement: str = "loop") -> float:
    """Blocks' worth of work of pipeline rank ``rank``'s chunks (the head not counted): a block held
    in half counts its half's share."""
    return sum(halves_work(*_stage_halves(split, pp, rank, c, placement), attention_share)
               for c in range(len(split) // pp))


def recomputed_work(split: Sequence[float], stage: int, every: int, attention_share: float) -> float:
    """Blocks' worth of forward work virtual stage ``stage`` repeats in its backward under full
    recompute: each stage checkpoints its every ``every``-th block from its first (as
    ``apply_activation_checkpointing`` counts), so a stage of n blocks repeats ceil(n / every) of them,
    not n / every; a block held in half repeats its half."""
    bounds = _half_bounds(tuple(split))
    start, end = bounds[stage], bounds[stage + 1]
    return sum(halves_work(max(start, 2 * block), min(end, 2 * block + 2), attention_share)
               for index, block in enumerate(range(start // 2, (end + 1) // 2)) if index % every == 0)


def stage_layers(split: Sequence[float], pp: int, rank: int, chunk: int = 0, placement: str = "loop") -> range:
    """Global indices of the blocks chunk ``chunk`` of pipeline rank ``rank`` (virtual stage
    ``placement.stage_of``) holds, whole or in part (see ``stage_parts``)."""
    start, end = _stage_halves(split, pp, rank, chunk, placement)
    return range(start // 2, (end + 1) // 2)


def stage_parts(split: Sequence[float], pp: int, rank: int, chunk: int = 0,
                placement: str = "loop") -> dict[int, tuple[str, ...]]:
    """The blocks of that chunk it holds only in part, each with the part it holds: ``("mlp",)`` for a
    block whose attention the previous stage ran, ``("attention",)`` for one whose MLP the next stage
    runs. Empty for a split of whole blocks."""
    start, end = _stage_halves(split, pp, rank, chunk, placement)
    attention, mlp = BLOCK_PARTS
    parts = {}
    if start % 2:
        parts[start // 2] = (mlp,)
    if end % 2:
        parts[end // 2] = (attention,)
    return parts
