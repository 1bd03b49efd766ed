"""Pipeline schedules as plain data: which forward and backward each rank runs, in what order.

A schedule is a list of ``Op`` per pipeline rank, computed without any process or tensor, so the
orders can be read, printed and checked in a unit test before anything runs. The executor
interprets these lists; the communication they imply is derived from them in ``comm_plan``.

Model chunks and virtual stages: with ``v`` chunks per rank (interleaved 1F1B) the model is cut
into ``pp * v`` virtual stages and rank ``r`` holds stages ``r, r + pp, r + 2 pp, ...``; its chunk
``c`` is virtual stage ``c * pp + r``. Plain 1F1B is the case ``v = 1``. ZB-V places its two chunks
a rank in a V instead (``placement``): rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``.

Split backward (zero-bubble schedules): an ``F`` is a forward and a ``B`` the whole backward, except
in a schedule that also holds ``W`` ops; there ``B`` computes only the input gradient (what the
previous stage waits for) and ``W`` the same micro-batch's weight gradients, which nothing waits for
and so can be moved into the bubble.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from parallel.pipeline.placement import V_SHAPED
from parallel.pipeline.v_order import RunSpan, check_costs, modelled_bubble, v_orders

SCHEDULES = ("gradient_accumulation", "1f1b", "interleaved_1f1b", "zb-h1", "zb-h2", "interleaved_zb", "zb-v",
             "forward_only")
TRAINING_SCHEDULES = ("auto",) + SCHEDULES[:-1]
"""The choices of ``parallel.pipeline_schedule``: ``auto`` is ``default_schedule``."""
SPLIT_BACKWARD = ("zb-h1", "zb-h2", "interleaved_zb", "zb-v")
"""The schedules that run weight gradients as ops of their own (``W``), apart from ``B``."""
INTERLEAVED = ("interleaved_1f1b", "interleaved_zb")
"""The schedules of several model chunks per rank (virtual stages) placed in a loop, which exchange
before each steady-state forward/backward pair (``plan.comm_plan``)."""


@dataclass(frozen=True, order=True)
class Op:
    """A forward (``F``), backward (``B``) or deferred weight gradient (``W``) of micro-batch
    ``microbatch`` on model chunk ``chunk``."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


def _check(pp: int, rank: int, m: int, v: int = 1) -> None:
    if pp < 1 or v < 1 or m < 1:
        raise ValueError(f"pipeline sizes must be positive: pp={pp} micro-batches={m} virtual stages={v}")
    if not 0 <= rank < pp:
        raise ValueError(f"pipeline rank {rank} is outside 0..{pp - 1}")


def gradient_accumulation(pp: int, rank: int, m: int, v: int = 1) -> list[Op]:
    """No pipelining: each micro-batch goes forward and backward before the next starts.

    With pp = 1 this is plain gradient accumulation; with pp > 1 it is correct but serial (the
    bubble is (pp - 1) / pp), which makes it the baseline the pipelined schedules are measured by.
    """
    _check(pp, rank, m, v)
    if v != 1:
        raise ValueError("gradient_accumulation runs one model chunk per rank; set virtual stages to 1")
    return [op for i in range(m) for op in (Op("F", i), Op("B", i))]


def one_f_one_b(pp: int, rank: int, m: int, v: int = 1) -> list[Op]:
    """PipeDream-flush: pp - rank - 1 warm-up forwards, then one forward / one backward, then cool-down.

    Stage ``rank`` never holds more than ``pp - rank`` micro-batches' activations, whatever ``m`` is.
    """
    _check(pp, rank, m, v)
    if v != 1:
        raise ValueError("1f1b runs one model chunk per rank; use interleaved_1f1b for virtual stages > 1")
    return _warmup_then_pairs(m, pp - rank - 1)


def _warmup_then_pairs(m: int, warmup: int) -> list[Op]:
    """``warmup`` forwards, then one forward / one backward, then the cool-down's backwards."""
    warmup = min(warmup, m)
    ops = [Op("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [Op("F", warmup + i), Op("B", i)]
    return ops + [Op("B", i) for i in range(m - warmup, m)]


def _split_weight_grads(ops: list[Op], delay: int) -> list[Op]:
    """``ops`` with each ``B`` followed by the oldest waiting weight gradient ``W`` once more than
    ``delay`` wait, and the rest after the last op."""
    out: list[Op] = []
    waiting: list[Op] = []
    for op in ops:
        out.append(op)
        if op.kind == "B":
            waiting.append(Op("W", op.microbatch, op.chunk))
            while len(waiting) > delay:
                out.append(waiting.pop(0))
    return out + waiting


def zero_bubble_h1(pp: int, rank: int, m: int, v: int = 1, delay: Optional[int] = None) -> list[Op]:
    """ZB-H1 (Qi et al. 2023): 1F1B with each backward split into ``B`` then ``W``; rank ``r`` keeps
    up to ``r`` weight gradients waiting, and runs them where 1F1B would idle.

    1F1B's warm-up and its F/B alternation are kept, so the critical path (forwards down, input
    gradients up) is 1F1B's with ``B`` shorter by ``W``. After each ``B`` the oldest waiting ``W``
    runs once more than ``r`` wait; the cool-down is ``B W`` pairs, then the remaining ``W``s. A
    micro-batch's activations live from its ``F`` to its ``W``, so every rank holds at most ``pp``
    (``m`` if fewer): rank 0's 1F1B peak, which sets the memory 1F1B needs anyway. With F, B and W
    of equal cost the bubble is (pp - 1) units against 1F1B's 3 (pp - 1): a third. ``delay`` replaces
    ``r`` as the number of weight gradients left waiting (``plan.weight_grad_delays`` picks it from
    the stages' op costs).
    """
    return _split_backward_1f1b("zb-h1", pp, rank, m, v, pp - rank - 1, delay)


def zero_bubble_h2(pp: int, rank: int, m: int, v: int = 1, delay: Optional[int] = None) -> list[Op]:
    """ZB-H2 (Qi et al. 2023): ZB-H1 with twice its warm-up, 2 (pp - 1 - r) forwards on rank ``r``.

    The extra forwards fill the time a rank would otherwise wait for its first input gradient when
    the stages are unequal (at equal F, B and W costs it idles as much as ZB-H1: see
    ``bubble_fraction``). The price is memory: rank 0 holds up to 2 pp - 1 micro-batches'
    activations (ZB-H1 and 1F1B: pp). At pp 2 with 8 micro-batches and GPT 1.3B's measured op
    times this is the schedule that leaves least of the step idle (BENCHMARKS.md). It needs
    activations and gradients on separate channels (``plan.CHANNELS``): on one in-order stream the
    extra forwards' sends would wait behind the gradients their receiver has yet to send. ``delay`` as
    in ``zero_bubble_h1``.
    """
    return _split_backward_1f1b("zb-h2", pp, rank, m, v, 2 * (pp - rank - 1), delay)


def _split_backward_1f1b(name: str, pp: int, rank: int, m: int, v: int, warmup: int,
                         delay: Optional[int]) -> list[Op]:
    """1F1B's order with ``warmup`` forwards, its backwards split (``_split_weight_grads``) with
    ``delay`` (default ``rank``) weight gradients left waiting."""
    _check(pp, rank, m, v)
    if v != 1:
        raise ValueError(f"{name} runs one model chunk per rank; set virtual stages to 1")
    return _split_weight_grads(_warmup_then_pairs(m, warmup), _delay(name, rank, delay))


def _delay(name: str, rank: int, delay: Optional[int]) -> int:
    """How many weight gradients a rank leaves waiting: ``delay``, by default its index."""
    delay = rank if delay is None else delay
    if delay < 0:
        raise ValueError(f"{name}: weight gradients left waiting must be >= 0, got {delay}")
    return delay


def _chunk_order(pp: int, m: int, v: int, backward: bool) -> list[tuple[int, int]]:
    """(chunk, micro-batch) in the order a rank visits them: pp micro-batches per chunk at a time.

    Micro-batches go in groups of ``pp``; a group passes through every chunk before the next group
    starts, so a rank's chunks take turns. Backward visits chunks last to first.
    """
    def key(pair: tuple[int, int]) -> tuple[int, int, int]:
        chunk, mb = pair
        return mb // pp, (v - 1 - chunk) if backward else chunk, mb % pp

    return sorted(((c, i) for c in range(v) for i in range(m)), key=key)


def interleaved_1f1b(pp: int, rank: int, m: int, v: int = 2) -> list[Op]:
    """1F1B over ``v`` model chunks per rank (Narayanan et al. 2021): the bubble shrinks by ``v``.

    The warm-up is longer than plain 1F1B: the last rank must run the first micro-batch through
    ``v - 1`` earlier chunks before its first backward, and each earlier rank runs two more
    forwards than the next one so the steady state alternates without waiting.
    """
    _check(pp, rank, m, v)
    forward, backward = _chunk_order(pp, m, v, False), _chunk_order(pp, m, v, True)
    total = m * v
    warmup = interleaved_warmup(pp, rank, m, v)
    ops = [Op("F", mb, c) for c, mb in forward[:warmup]]
    for k in range(total - warmup):
        (fc, fmb), (bc, bmb) = forward[warmup + k], backward[k]
        ops += [Op("F", fmb, fc), Op("B", bmb, bc)]
    return ops + [Op("B", mb, c) for c, mb in backward[total - warmup:]]


def interleaved_zero_bubble(pp: int, rank: int, m: int, v: int = 2, delay: Optional[int] = None) -> list[Op]:
    """Interleaved 1F1B with each backward split into ``B`` and ``W``, rank ``r`` leaving up to ``r``
    weight gradients waiting (``delay``), as ZB-H1 does with one chunk.

    The later ranks' first wait is a chunk's forward instead of a whole stage's, which is the point:
    at pp 2 with two chunks and equal op costs the idle time is half of ZB-H1's, with less memory
    than ZB-H2 on the first rank (``bubble_fraction``). The waiting ``W``s run right after the
    exchange that starts the next forward/backward pair (``plan.comm_plan``), so the gradient a ``B``
    sends leaves before them, and they fill the time the pair waits for its inputs.
    """
    _check(pp, rank, m, v)
    if v < 2:
        raise ValueError("interleaved_zb needs more than one model chunk per rank; raise virtual stages")
    return _split_weight_grads(interleaved_1f1b(pp, rank, m, v), _delay("interleaved_zb", rank, delay))


def zero_bubble_v(pp: int, rank: int, m: int, v: int = 2, costs: Optional[Sequence[Sequence[float]]] = None,
                  runs: Optional[RunSpan] = None) -> list[Op]:
    """ZB-V (``v_order``): two chunks a rank in a V, ordered by list scheduling with each
    virtual stage's (F, B, W) ``costs`` (none: equal), among orders ``runs`` finds deadlock-free."""
    _check(pp, rank, m, v)
    if pp < 2 or v != 2:
        raise ValueError(f"zb-v runs two model chunks on each of at least two pipeline ranks; got pp {pp}, "
                         f"virtual stages {v}")
    return [Op(*op) for op in v_orders(pp, m, check_costs(pp, costs), runs)[0][rank]]


def forward_only(pp: int, rank: int, m: int, v: int = 1) -> list[Op]:
    """Evaluation: every forward, chunks visited in the interleaved order, no backward."""
    _check(pp, rank, m, v)
    return [Op("F", mb, c) for c, mb in _chunk_order(pp, m, v, False)]


def interleaved_warmup(pp: int, rank: int, m: int, v: int) -> int:
    """Forwards before the first backward in interleaved 1F1B.

    With m == pp every forward goes first: a steady state there would pair a backward with the very
    forward it waits for, and the exchange that pairs share (see ``plan.comm_plan``) could not finish.
    When m is not a multiple of pp the last group of micro-batches is partial and the usual warm-up
    deadlocks for some ranks, so every forward goes first there too: correct for any m (the plan
    simulator checks pp up to 8, v up to 4), at the price of holding all m·v chunk activations at once,
    as GPipe does. Choose m as a multiple of pp to keep the 1F1B memory bound.
    """
    total = m * v
    return total if forwards_first(pp, m) else min((pp - rank - 1) * 2 + (v - 1) * pp, total)


def forwards_first(pp: int, m: int) -> bool:
    """Whether an interleaved schedule of ``m`` micro-batches runs every forward first
    (``interleaved_warmup``): ``m`` is pp, or not a multiple of it."""
    return m == pp or m % pp != 0


_BUILDERS: dict[str, Callable[..., list[Op]]] = {
    "gradient_accumulation": gradient_accumulation,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb-h1": zero_bubble_h1,
    "zb-h2": zero_bubble_h2,
    "interleaved_zb": interleaved_zero_bubble,
    "zb-v": zero_bubble_v,
    "forward_only": forward_only,
}


def build_schedule(name: str, pp: int, rank: int, m: int, v: int = 1, delay: Optional[int] = None) -> list[Op]:
    """The op list of pipeline rank ``rank`` for schedule ``name``; ``delay`` (split-backward schedules
    only) is how many weight gradients the rank leaves waiting, see ``zero_bubble_h1``."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown pipeline schedule {name!r}; expected one of {SCHEDULES}")
    if delay is None or name in V_SHAPED:  # zb-v orders its weight gradients itself
        return _BUILDERS[name](pp, rank, m, v)
    if name not in SPLIT_BACKWARD:
        raise ValueError(f"{name} has no weight-gradient ops to delay")
    return _BUILDERS[name](pp, rank, m, v, delay)


def schedule_problem(name: str, v: int) -> Optional[str]:
    """Why training schedule ``name`` cannot run ``v`` model chunks per rank (None when it can)."""
    if name in V_SHAPED:
        return None if v == 2 else (f"{name} runs two model chunks per rank of a pipeline; set "
                                    "parallel.virtual_stages to 2, with parallel.pp 2 or more (on one GPU, another "
                                    "schedule)")
    if name in INTERLEAVED and v == 1:
        return f"{name} needs more than one model chunk per rank; raise parallel.virtual_stages"
    if name not in ("auto", *INTERLEAVED, *V_SHAPED) and v > 1:
        return (f"{name} runs one model chunk per rank; set parallel.virtual_stages to 1 or use one of "
                f"{', '.join(INTERLEAVED)}")
    return None


def default_schedule(pp: int, v: int) -> str:
    """1F1B for pipelines, its interleaved form with virtual stages, plain accumulation without pp."""
    if v > 1:
        return "interleaved_1f1b"
    return "1f1b" if pp > 1 else "gradient_accumulation"


def splits_backward(ops: list[Op]) -> bool:
    """Whether ``ops`` run weight gradients as ops of their own (``W``), apart from ``B``."""
    return any(op.kind == "W" for op in ops)


def max_live_activations(ops: list[Op], chunk_weights: Optional[Sequence[float]] = None) -> float:
    """Most micro-batch chunks whose forward has run and whose backward (its ``W``, when the backward
    is split: the weight gradient still needs the layer inputs) has not, at any point of ``ops``; with
    ``chunk_weights``, the most of their summed weights (a chunk's activation bytes, say: a rank's
    chunks need not hold equal work, and which of them are in flight at the peak is the schedule's)."""
    peaks = live_peaks(ops)
    return weighted_peak(peaks, [1] * len(peaks[0]) if chunk_weights is None and peaks else chunk_weights)


def weighted_peak(peaks: Sequence[tuple[int, ...]], weights: Sequence[float]) -> float:
    """The most summed chunk ``weights`` over ``peaks`` (``live_peaks``; 0 for none). The same peak
    as a scan of the ops adding and removing weights one by one, up to the last bit of rounding: the
    sums are formed in another order. Too few weights for the chunks raises IndexError."""
    return max((sum(n * weights[c] for c, n in enumerate(counts)) for counts in peaks), default=0)


def live_peaks(ops: Sequence[Op]) -> list[tuple[int, ...]]:
    """The micro-batches in flight in each chunk at the fullest points of ``ops``: every count vector
    reached after a forward that no other point matches or exceeds in every chunk. Whatever each
    chunk's weight (its bytes, never negative), ``max_live_activations``'s peak is at one of them, so
    a planner weighing many layouts of one schedule keeps these and not the op list (``weighted_peak``)."""
    done = "W" if splits_backward(ops) else "B"
    live = [0] * (1 + max((op.chunk for op in ops), default=0))
    reached = set()
    for op in ops:
        if op.kind == "F":
            live[op.chunk] += 1
            reached.add(tuple(live))
        elif op.kind == done:
            live[op.chunk] -= 1
    front: list[tuple[int, ...]] = []  # a vector can only be matched or exceeded by one of no smaller sum
    for counts in sorted(reached, key=sum, reverse=True):
        if not any(all(a >= b for a, b in zip(kept, counts)) for kept in front):
            front.append(counts)
    return front


def bubble_fraction(pp: int, m: int, v: int = 1, schedule: str = "1f1b") -> float:
    """Idle time over useful time in theory, with every stage equally fast: (pp - 1) / (v m).

    This is the ratio of Narayanan et al.; as a share of the whole step it is (pp-1) / (v m + pp-1).
    ZB-H1 idles (pp - 1)(T_F + T_B - T_W) against 1F1B's (pp - 1)(T_F + T_B + T_W) (Qi et al.), a
    third of it when the forward, input-gradient and weight-gradient halves cost the same. ZB-H2 idles
    as much at equal costs when m >= 2 pp (the first rank's forward is a floor no order removes;
    ``plan.timeline`` with unit costs agrees), more with fewer micro-batches (pp 4, m 4: 0.33 against
    0.25), for which this figure is low; its gain is with unequal stages, where its extra warm-up
    forwards fill what the slower stage leaves idle. ``interleaved_zb`` idles (2 pp - 3) / (3 v m) when
    m is a multiple of pp above it (``plan.timeline`` with unit costs gives exactly that for pp up to
    8 and v up to 3): a third of interleaved 1F1B's at pp 2, half of ZB-H1's there with two chunks,
    tending to two thirds of interleaved 1F1B's as pp grows; two thirds of it at m = pp, where every
    forward goes first. When m is not a multiple of pp every forward goes first too and it idles at
    least interleaved 1F1B's figure, which is returned as a floor. Without pipelining
    (``gradient_accumulation``) each stage idles while the other ``pp - 1`` work, whatever m.
    """
    if schedule == "gradient_accumulation":
        return float(pp - 1)
    if schedule in V_SHAPED:
        return modelled_bubble(pp, m)
    ratio = (pp - 1) / (v * m)
    if schedule == "interleaved_zb":
        return ratio if m % pp else ratio * 2 / 3 if m == pp else (2 * pp - 3) / (3 * v * m)
    return ratio / 3 if schedule in SPLIT_BACKWARD else ratio
