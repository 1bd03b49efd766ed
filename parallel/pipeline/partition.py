"""Which transformer blocks each pipeline stage holds.

A split is a list with the number of blocks of each virtual stage (``pp * v`` entries, in virtual-
stage order). It comes from the user (``parallel.pipeline_split``) or is uniform. The embedding and
head are large at small widths (a 50k x 1024 embedding outweighs four blocks), so a user whose end
stages are slowest gives them fewer blocks with an explicit split.
"""

from __future__ import annotations

from typing import Optional, Sequence


def uniform_split(num_layers: int, stages: int) -> list[int]:
    """Blocks as evenly as possible; the middle stages take the remainder (the ends carry embedding/head)."""
    _check_counts(num_layers, stages)
    base, extra = divmod(num_layers, stages)
    order = sorted(range(stages), key=lambda s: (s in (0, stages - 1), s))
    bonus = set(order[:extra])
    return [base + (s in bonus) for s in range(stages)]


def split_problem(num_layers: int, pp: int, v: int = 1, split: Optional[Sequence[int]] = None) -> Optional[str]:
    """Why a run's split cannot work, in config terms, or None: a given split must list ``pp * v``
    positive block counts summing to ``num_layers``; without one, a run's blocks must divide evenly
    over the virtual stages (an uneven layout is asked for by giving it). Config validation reports
    this before launch; ``resolve_split`` refuses a bad given split."""
    stages = pp * v
    if split is not None:
        split = list(split)
        if len(split) != stages or any(not isinstance(k, int) or k < 1 for k in split) or sum(split) != num_layers:
            return (f"parallel.pipeline_split: {split} must be {stages} positive layer counts "
                    f"(pp*virtual_stages = {pp}*{v}) summing to model.num_layers {num_layers}")
    elif num_layers % stages:
        return (f"model.num_layers: {num_layers} is not divisible by parallel.pp*parallel.virtual_stages "
                f"= {stages}; change the layer count or give parallel.pipeline_split")
    return None


def resolve_split(num_layers: int, pp: int, v: int = 1, split: Optional[Sequence[int]] = None) -> list[int]:
    """The user's split if given (validated), else uniform."""
    stages = pp * v
    if split is not None:
        problem = split_problem(num_layers, pp, v, split)
        if problem:
            raise ValueError(problem)
        return list(split)
    return uniform_split(num_layers, stages)


def stage_layers(split: Sequence[int], pp: int, rank: int, chunk: int = 0) -> range:
    """Global block indices held by chunk ``chunk`` of pipeline rank ``rank`` (virtual stage chunk*pp + rank)."""
    stage = chunk * pp + rank
    if not 0 <= stage < len(split):
        raise ValueError(f"virtual stage {stage} (rank {rank}, chunk {chunk}) is outside a {len(split)}-stage split")
    start = sum(split[:stage])
    return range(start, start + split[stage])


def _check_counts(num_layers: int, stages: int) -> None:
    if stages < 1:
        raise ValueError(f"need at least one pipeline stage, got {stages}")
    if num_layers < stages:
        raise ValueError(f"{num_layers} blocks cannot fill {stages} pipeline stages: every stage needs at least "
                         f"one block; lower pp x virtual stages or add layers")
