"""Which transformer blocks each pipeline stage holds.

A split is a list with the number of blocks of each virtual stage (``pp * v`` entries, in virtual-
stage order). It comes from one of three places: the user (``parallel.pipeline_split``), a uniform
division, or a balance of per-stage cost in which the first stage also pays for the embedding and
the last for the LM head and loss. The embedding and head are large at small widths (a 50k x 1024
embedding outweighs four blocks), so uniform splits leave the end stages slowest.
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


def balanced_split(num_layers: int, stages: int, block_cost: float, first_cost: float = 0.0,
                   last_cost: float = 0.0) -> list[int]:
    """The split minimising the costliest stage, when stage 0 also costs ``first_cost`` and the last ``last_cost``.

    Exact (dynamic programming over contiguous splits); every stage keeps at least one block; ties
    prefer the more uniform split.
    """
    _check_counts(num_layers, stages)
    if block_cost <= 0:
        raise ValueError(f"block cost must be positive, got {block_cost}")

    def cost(stage: int, blocks: int) -> float:
        return blocks * block_cost + (first_cost if stage == 0 else 0.0) + (last_cost if stage == stages - 1 else 0.0)

    # best[s][n]: (max stage cost, spread) of the first s stages holding n blocks, and the split
    best: dict[tuple[int, int], tuple[tuple[float, int], list[int]]] = {(0, 0): ((0.0, 0), [])}
    for s in range(stages):
        for n in range(num_layers + 1):
            prev = best.get((s, n))
            if prev is None:
                continue
            for k in range(1, num_layers - n + 1):
                split = prev[1] + [k]
                key = (max(prev[0][0], cost(s, k)), max(split) - min(split))
                if (s + 1, n + k) not in best or key < best[(s + 1, n + k)][0]:
                    best[(s + 1, n + k)] = (key, split)
    return best[(stages, num_layers)][1]


def decoder_costs(hidden: int, ffn: int, vocab: int, seq_length: int, by: str = "flops") -> tuple[float, float, float]:
    """(block, embedding, head + loss) costs of a decoder, by parameter count or forward flops per token.

    Attention projections are 4 h^2 and the MLP 2 h ffn parameters; attention scores add 2 s h flops
    per token. The embedding lookup costs no flops but its parameters (and their optimizer state) count.
    """
    block_params = 4 * hidden * hidden + 2 * hidden * ffn
    if by == "params":
        return float(block_params), float(vocab * hidden), float(vocab * hidden)
    if by == "flops":
        return float(2 * block_params + 4 * seq_length * hidden), 0.0, float(2 * vocab * hidden)
    raise ValueError(f"cost must be 'params' or 'flops', got {by!r}")


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


def resolve_split(num_layers: int, pp: int, v: int = 1, split: Optional[Sequence[int]] = None,
                  costs: Optional[tuple[float, float, float]] = None) -> list[int]:
    """The user's split if given (validated), else balanced by ``costs``, else uniform."""
    stages = pp * v
    if split is not None:
        problem = split_problem(num_layers, pp, v, split)
        if problem:
            raise ValueError(problem)
        return list(split)
    if costs is not None:
        return balanced_split(num_layers, stages, *costs)
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
