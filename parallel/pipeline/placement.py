"""Which pipeline rank holds which virtual stage.

With ``v`` chunks a rank the model is cut into ``pp * v`` virtual stages, and two placements are in use:

- ``loop`` (interleaved 1F1B, Narayanan et al. 2021): chunk ``c`` of rank ``r`` is stage ``c * pp + r``;
  a micro-batch passes down the ranks ``v`` times, and every hand-over between stages crosses ranks.
- ``v`` (ZB-V, Qi et al. 2024): two chunks a rank, rank ``r`` holding stage ``r`` and stage
  ``2 pp - 1 - r``; a micro-batch goes down the ranks and comes back up. The first rank holds both the
  embedding and the head, and the last rank hands its first chunk's output to its second without any
  transfer: a micro-batch crosses ranks ``2 (pp - 1)`` times against the loop's ``2 pp - 1``.

The placement follows from the schedule (``placement_of``), so a config names only the schedule.
"""

from __future__ import annotations

V_SHAPED = ("zb-v",)
"""The schedules that place their two chunks a rank in a V."""


def placement_of(schedule: str) -> str:
    """``v`` for the V-shaped schedules, ``loop`` for every other."""
    return "v" if schedule in V_SHAPED else "loop"


def stage_of(pp: int, rank: int, chunk: int, placement: str = "loop") -> int:
    """The virtual stage chunk ``chunk`` of pipeline rank ``rank`` runs."""
    if placement == "v":
        if chunk not in (0, 1):
            raise ValueError(f"a V-shaped pipeline holds two chunks a rank, not chunk {chunk}")
        return rank if chunk == 0 else 2 * pp - 1 - rank
    if placement != "loop":
        raise ValueError(f"unknown stage placement {placement!r}; expected 'loop' or 'v'")
    return chunk * pp + rank


def holder_of(pp: int, stage: int, placement: str = "loop") -> tuple[int, int]:
    """(pipeline rank, chunk) that runs virtual stage ``stage``."""
    if placement == "v":
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp


def rank_stages(pp: int, rank: int, v: int, placement: str = "loop") -> list[int]:
    """The virtual stage of each chunk of pipeline rank ``rank``, chunk by chunk."""
    return [stage_of(pp, rank, c, placement) for c in range(v)]


def neighbours(pp: int, rank: int, v: int, placement: str = "loop") -> list[int]:
    """The pipeline ranks holding a stage next to one of rank ``rank``'s: those it exchanges with."""
    last = pp * v - 1
    return sorted({holder_of(pp, t, placement)[0] for s in rank_stages(pp, rank, v, placement)
                   for t in (s - 1, s + 1) if 0 <= t <= last} - {rank})


def sends_per_microbatch(pp: int, rank: int, v: int, placement: str = "loop") -> int:
    """How many messages rank ``rank`` sends for one micro-batch: an activation after each of its
    stages whose next stage another rank holds, a gradient before each whose previous one does.
    At pp 2 a loop with two chunks sends 3 a rank and a V 2 (its turn stays on the last rank)."""
    last = pp * v - 1
    return sum((s < last and holder_of(pp, s + 1, placement)[0] != rank)
               + (s > 0 and holder_of(pp, s - 1, placement)[0] != rank)
               for s in rank_stages(pp, rank, v, placement))
