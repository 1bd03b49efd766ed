"""ZB-V (Qi et al. 2024): two chunks a rank placed in a V, backward split into ``B`` and ``W``.

Why a V: after every optimizer step each later rank waits for the forwards before it, a whole stage
each under ZB-H1 and ZB-H2. With the first rank holding the first and the last virtual stage
(``placement``), that wait is a chunk of about half a stage, and the cool-down's last input gradients
run on the rank that holds the deferred weight gradients to fill it: at equal costs the bubble is
half ZB-H1's at pp 2. Where the stages are unequal it pays only if the wait falls on the busiest
rank: GPT 1.3B at pp 2 on H200s ran 1% slower than ZB-H2, whose 40 ms wait is on its lighter rank
while ZB-V's shorter one is on its busier (BENCHMARKS.md).

How the order is found: by list scheduling the ops of every rank with the stages' op costs, as the
paper's own scheduler does rather than a fixed pattern, so unequal stages (the head's weight on the
last one) shape the order. Each rank, whenever it is free, runs the first of: an input gradient
``B`` whose gradient has arrived, a forward ``F`` whose input has arrived, the oldest waiting weight
gradient ``W``; otherwise it idles until an input arrives. Among ready ``B`` and ``F`` the deeper
stage goes first (it is nearer the loss, so its backward comes sooner). A rank starts a first-chunk
forward only while fewer than ``cap`` micro-batch chunks are in flight on it (forward run, ``W`` not);
second-chunk forwards are not held back: each leads straight to a backward, and holding them could
leave a rank full of first-chunk forwards waiting for a backward only its second chunk can start.
``cap`` is searched from ``2 pp`` (1F1B's peak, counted in half stages) to ``2 (2 pp - 1)`` (ZB-H2's
first rank), keeping the smallest that gives the shortest modelled step. Every rank computes all
ranks' orders from the same costs, so the plans match. Messages take no time in this model, and a
rank's next op waits only for its own input; the executor's exchanges are batches per channel that
complete as a whole (NCCL), so from pp 3 a middle rank's receive for its next forward can wait on
a send its previous op made to a rank that takes it only after a backward that waits on this rank:
with unequal stages (the head's forward on the last) most caps' orders deadlock there. So each order
is checked by the plan's dry run (``plan.v_orders_span``, ``timeline``'s NCCL channel semantics),
an order that deadlocks is passed over, and where every cap's does, the equal-cost order (which
runs at every size the tests check, pp up to 16) is taken.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

from parallel.pipeline.placement import holder_of, stage_of

UNIT_STAGE = (1.0, 1.0, 1.0)
"""A stage's (forward, input gradient, weight gradient) cost when none is given: equal thirds."""


def check_costs(pp: int, costs: Optional[Sequence[Sequence[float]]]) -> tuple:
    """``costs`` as a table of each virtual stage's (F, B, W), in stage order (``2 pp`` entries; none:
    ``UNIT_STAGE`` each)."""
    table = tuple(tuple(float(x) for x in c) for c in costs) if costs is not None else (UNIT_STAGE,) * (2 * pp)
    if len(table) != 2 * pp or any(len(c) != 3 or min(c) < 0 for c in table):
        raise ValueError(f"zb-v needs (F, B, W) costs, none negative, for each of its {2 * pp} virtual stages")
    return table


RunSpan = Callable[[int, Sequence[Sequence[tuple]], tuple], Optional[float]]
"""(pp, every rank's ops, costs) -> the step their plans take, or None where they deadlock: the plan's
dry run (``plan.v_orders_span``), which this module cannot import (the plan builds on the schedules,
which build on it), so its callers that run orders hand it in."""


@functools.lru_cache(maxsize=256)
def v_orders(pp: int, m: int, costs: tuple, runs: Optional[RunSpan] = None) -> tuple[tuple[tuple, ...], float]:
    """Every rank's ops as (kind, micro-batch, chunk) and the modelled step, for ``costs`` (a
    ``check_costs`` table), at the cap that gives the shortest step (the smallest such). Given
    ``runs``, only among orders whose plans cannot deadlock; if none, the equal-cost order, its step
    timed by ``runs``: see the module docstring."""
    found = [_list_schedule(pp, m, costs, cap) for cap in range(2 * pp, 2 * (2 * pp - 1) + 1)]
    while found:
        best = None
        for ops, span in found:
            if best is None or span < best[1] * (1 - 1e-9):
                best = (ops, span)
        if runs is None or runs(pp, best[0], costs) is not None:
            return best
        found.remove(best)
    unit = check_costs(pp, None)
    if costs != unit:
        ops, _ = v_orders(pp, m, unit, runs)
        return ops, runs(pp, ops, costs)
    raise ValueError(f"parallel.pipeline_schedule zb-v finds no order for pp {pp} and {m} micro-batches that "
                     f"cannot deadlock; use zb-h1 or zb-h2")


def modelled_bubble(pp: int, m: int, costs: Optional[tuple] = None) -> float:
    """Idle over busy time of the idlest rank in the list-scheduling model (messages free); with equal
    costs, ``schedule.bubble_fraction``'s figure for zb-v."""
    span, busy = modelled_span(pp, m, costs)
    return max((span - b) / b for b in busy)


def modelled_span(pp: int, m: int, costs: Optional[tuple] = None,
                  runs: Optional[RunSpan] = None) -> tuple[float, list[float]]:
    """The step the list-scheduling model gives (messages free), and each rank's busy time in it;
    ``runs`` as in ``v_orders``."""
    table = check_costs(pp, costs)
    _, span = v_orders(pp, m, table, runs)
    return span, [m * (sum(table[stage_of(pp, r, 0, "v")]) + sum(table[stage_of(pp, r, 1, "v")])) for r in range(pp)]


def _list_schedule(pp: int, m: int, costs: tuple, cap: int) -> tuple[tuple[tuple, ...], float]:
    """Every rank's ops as (kind, micro-batch, chunk) and when the last ends, first-chunk forwards held
    to ``cap`` in flight a rank. Each rank's next op is kept and found again only when an op changes
    what it depends on: one of the rank's own, or the neighbouring stage's op whose output it waits
    for. Finding every rank's afresh after each op took 4.8 s for pp 16 and 64 micro-batches (1.0 s
    so), and ``megazero plan`` of GPT 6.7B under zb-v on 64 GPUs, which orders many such, 5 minutes."""
    last = 2 * pp - 1
    ends = {kind: [[None] * m for _ in range(2 * pp)] for kind in "FB"}  # ends[kind][stage][mb]
    free = [0.0] * pp
    next_f = [[0, 0] for _ in range(pp)]  # next micro-batch to go forward / backward, by chunk:
    next_b = [[0, 0] for _ in range(pp)]  # each chunk runs its micro-batches in order
    waiting_w: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    live = [0] * pp
    ops: list[list] = [[] for _ in range(pp)]

    def next_op(r: int) -> Optional[tuple]:
        """Rank ``r``'s op to run next, as (start, priority, -stage, rank, kind, chunk, micro-batch)."""
        options = []
        for c in (0, 1):
            s = stage_of(pp, r, c, "v")
            mb = next_b[r][c]
            if mb < next_f[r][c]:  # its forward ran here
                arrived = ends["F"][s][mb] if s == last else ends["B"][s + 1][mb]
                if arrived is not None:
                    options.append((max(arrived, free[r]), 0, -s, r, "B", c, mb))
            mb = next_f[r][c]
            if mb < m and (c == 1 or live[r] < cap):
                arrived = 0.0 if s == 0 else ends["F"][s - 1][mb]
                if arrived is not None:
                    options.append((max(arrived, free[r]), 1, -s, r, "F", c, mb))
        if waiting_w[r]:
            c, mb = waiting_w[r][0]
            options.append((free[r], 2, 0, r, "W", c, mb))
        if not options:
            return None
        soonest = min(o[0] for o in options)
        return min((o for o in options if o[0] <= soonest), key=lambda o: o[1:3])

    upcoming = [next_op(r) for r in range(pp)]
    for _ in range(6 * pp * m):
        pick = min((op for op in upcoming if op is not None), key=lambda op: (op[0], op[3]), default=None)
        if pick is None:
            raise RuntimeError(f"zb-v list scheduling stalled (pp {pp}, {m} micro-batches, cap {cap})")
        start, _, _, r, kind, c, mb = pick
        s = stage_of(pp, r, c, "v")
        end = start + costs[s]["FBW".index(kind)]
        free[r] = end
        ops[r].append((kind, mb, c))
        waiting = {r}  # the ranks whose next op this one can change
        if kind == "F":
            ends["F"][s][mb] = end
            next_f[r][c] += 1
            live[r] += 1
            if s < last:
                waiting.add(holder_of(pp, s + 1, "v")[0])
        elif kind == "B":
            ends["B"][s][mb] = end
            next_b[r][c] += 1
            waiting_w[r].append((c, mb))
            if s > 0:
                waiting.add(holder_of(pp, s - 1, "v")[0])
        else:
            waiting_w[r].pop(0)
            live[r] -= 1
        for q in waiting:
            upcoming[q] = next_op(q)
    return tuple(tuple(rank_ops) for rank_ops in ops), max(free)
