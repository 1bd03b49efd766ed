"""Which of a run's micro-batch counts can fill a pipeline rank the most. A batch ramp-up runs steps
of fewer micro-batches than the full batch, and not every schedule holds the most in flight at the
most micro-batches: a memory estimate must look at the counts named here, and may skip the rest."""

from __future__ import annotations

from typing import Optional, Sequence

from parallel.pipeline.placement import V_SHAPED
from parallel.pipeline.plan import StageCosts, tunes_delays
from parallel.pipeline.schedule import INTERLEAVED


def fullest_counts(schedule: str, pp: int, v: int, counts: Sequence[int],
                   costs: Optional[StageCosts] = None) -> list[int]:
    """The counts among ``counts`` (micro-batches per step) whose steps, between them, hold on every
    rank at least what a step of any other count holds in each chunk, largest first.

    With the default weight-gradient delays, each rank of a one-chunk schedule holds no fewer at more
    micro-batches, so the largest count covers the smaller. Interleaved schedules run every forward
    first at a count that is not a multiple of pp, or is pp (``interleaved_warmup``): that holds all of
    it, more than the steady state of a larger count, so the largest such count is looked at too. A
    count whose delays ``schedule_for`` tunes (only ever later, which holds no fewer) can hold more
    than a larger count does on some rank, and zb-v's list-scheduled order follows no rule: those
    counts are all kept. ``tests/test_pipeline_schedule.py`` checks the rules on every schedule."""
    largest = max(counts)
    if schedule in V_SHAPED:
        return sorted(set(counts), reverse=True)
    kept = {largest} | {c for c in counts if tunes_delays(schedule, pp, c, v, costs)}
    if schedule in INTERLEAVED:
        kept.add(max((c for c in counts if c % pp or c == pp), default=largest))
    return sorted(kept, reverse=True)
