"""Which of a run's micro-batch counts can fill a pipeline rank the most. A batch ramp-up runs steps
of fewer micro-batches than the full batch, and not every schedule holds the most in flight at the
most micro-batches: a memory estimate must look at the counts named here, and may skip the rest."""

from __future__ import annotations

from typing import Sequence

from parallel.pipeline.placement import V_SHAPED
from parallel.pipeline.schedule import INTERLEAVED, forwards_first


def fullest_counts(schedule: str, pp: int, v: int, counts: Sequence[int]) -> list[int]:
    """The counts among ``counts`` (micro-batches per step) whose steps, between them, hold on every
    rank at least what a step of any other count holds in each chunk, largest first; the steps of
    the largest count ordered by the op costs, the others by the schedule's default (as the executor
    runs them: ``costs_at``).

    In their default order, the ranks of a one-chunk schedule hold no fewer at more micro-batches, and
    the order tuned to the costs (``weight_grad_delays``) only ever holds more, so the largest count
    covers the smaller. Interleaved schedules run every forward first at a count that is not a
    multiple of pp, or is pp (``interleaved_warmup``): that holds all of it, more than the steady state
    of a larger count, so the largest such count is looked at too. zb-v's list-scheduled order
    follows no such rule: every count is kept. ``tests/test_pipeline_schedule.py`` checks the rules
    on every schedule."""
    largest = max(counts)
    if schedule in V_SHAPED:
        return sorted(set(counts), reverse=True)
    kept = {largest}
    if schedule in INTERLEAVED:
        kept.add(max((c for c in counts if forwards_first(pp, c)), default=largest))
    return sorted(kept, reverse=True)
