"""The point-to-point traffic a schedule implies, and a dry run that proves it cannot deadlock.

``comm_plan`` turns a rank's op list into steps: before each op, one batch that sends what the
previous op produced and receives what this op consumes. Posting a send together with the next
receive in one batch is what keeps neighbours from waiting on each other (rank r sends an activation
forward while rank r+1 sends a gradient back; posted as separate blocking calls both would wait
forever). ``timeline`` (and ``simulate``, its unit-cost form) runs all ranks' plans with NCCL's
semantics: each channel (``CHANNELS``: activations, gradients, on two communicators) completes its
operations in order, a batch of one channel meets its partner only once both have begun, and
messages are matched first-in first-out per ordered pair of ranks and channel with no tags. gloo is
looser (its sends and receives complete independently), so a plan that passes runs there too. On
NCCL the model assumes the two communicators' kernels can run side by side, which NCCL allows but
does not promise when ranks issue them in different orders: every schedule but ``zb-h2`` also passes
with both channels folded into one stream (the tests check it), and the executor refuses ``zb-h2``
where ``CUDA_DEVICE_MAX_CONNECTIONS=1`` would funnel all streams into one queue.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from parallel.pipeline.schedule import (INTERLEAVED, SPLIT_BACKWARD, Op, build_schedule, interleaved_warmup,
                                        max_live_activations, splits_backward)


@dataclass(frozen=True)
class Message:
    """What travels between stages: ``act`` goes to virtual stage ``stage + 1``, ``grad`` to ``stage - 1``."""

    kind: str
    microbatch: int
    stage: int

    def __repr__(self) -> str:
        return f"{self.kind}(mb{self.microbatch} from stage {self.stage})"


@dataclass(frozen=True)
class Transfer:
    peer: int
    message: Message


@dataclass(frozen=True)
class Step:
    """One batched exchange, then ``op`` (``None`` for the final flush of the last op's sends), which
    waits only for the message it consumes, ``needs``: received in this step's exchange or an earlier
    one (a pair's second op takes what the pair's exchange received)."""

    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]
    op: Optional[Op]
    needs: Optional[Message] = None


class PipelineDeadlock(RuntimeError):
    """A schedule whose communication cannot complete, or delivers a message to the wrong op."""


def virtual_stage(pp: int, rank: int, chunk: int) -> int:
    return chunk * pp + rank


def op_io(op: Op, pp: int, rank: int, v: int) -> tuple[Optional[Transfer], Optional[Transfer]]:
    """(what ``op`` receives, what it sends); ``None`` at the ends of the pipeline."""
    if pp == 1 and v > 1:
        raise ValueError("virtual stages need pp > 1: with one rank, use a deeper single chunk instead")
    s, last = virtual_stage(pp, rank, op.chunk), pp * v - 1
    if op.kind == "W":  # a weight gradient stays on its rank
        return None, None
    if op.kind == "F":
        recv = Transfer((s - 1) % pp, Message("act", op.microbatch, s - 1)) if s > 0 else None
        send = Transfer((s + 1) % pp, Message("act", op.microbatch, s)) if s < last else None
    else:
        recv = Transfer((s + 1) % pp, Message("grad", op.microbatch, s + 1)) if s < last else None
        send = Transfer((s - 1) % pp, Message("grad", op.microbatch, s)) if s > 0 else None
    return recv, send


def comm_plan(ops: list[Op], pp: int, rank: int, v: int = 1, paired_from: Optional[int] = None) -> list[Step]:
    """Steps of rank ``rank``: one batched exchange before each op, or before each steady-state pair.

    Plain 1F1B exchanges before every op: the sends of the op before, the receive of the op next.
    Interleaved 1F1B (``paired_from`` = its warm-up length) runs its steady state as forward/backward
    pairs with one exchange between pairs, carrying both ops' sends and both next receives; per-op
    exchanges there would cross activations and gradients travelling between the same two ranks.
    """
    steps: list[Step] = []
    pending: tuple[Transfer, ...] = ()
    for group in _groups(ops, paired_from):
        io = [op_io(op, pp, rank, v) for op in group]
        needs = [recv.message if recv else None for recv, _ in io]
        steps.append(Step(pending, tuple(recv for recv, _ in io if recv), group[0], needs[0]))
        steps += [Step((), (), op, need) for op, need in zip(group[1:], needs[1:])]
        pending = tuple(send for _, send in io if send)
    if pending:
        steps.append(Step(pending, (), None))
    return steps


def _groups(ops: list[Op], paired_from: Optional[int]) -> list[list[Op]]:
    """The ops in exchange groups: one each, or after ``paired_from`` warm-up forwards each steady-state
    forward/backward pair together; a weight gradient ``W`` (no traffic) joins the group after it, so
    the exchange that carries the last ``B``'s gradient is posted before it runs."""
    if paired_from is None:
        return [[op] for op in ops]
    groups = [[op] for op in ops[:paired_from]]
    k, waiting, pairing = paired_from, [], True
    while k < len(ops):
        if ops[k].kind == "W":
            waiting.append(ops[k])
            k += 1
            continue
        pair = pairing and k + 1 < len(ops) and ops[k].kind == "F" and ops[k + 1].kind == "B"
        pairing = pair
        groups.append(waiting + ops[k:k + (2 if pair else 1)])
        k, waiting = k + (2 if pair else 1), []
    return groups + ([waiting] if waiting else [])


def plan_for(schedule: str, pp: int, rank: int, m: int, v: int = 1,
             costs: Optional[StageCosts] = None) -> tuple[list[Op], list[Step]]:
    """The op list of ``schedule`` for this rank and the communication steps that carry it out; with
    the ranks' op ``costs`` a split-backward schedule delays its weight gradients as
    ``weight_grad_delays`` finds best."""
    ops = schedule_for(schedule, pp, rank, m, v, costs)
    paired_from = interleaved_warmup(pp, rank, m, v) if schedule in INTERLEAVED else None
    return ops, comm_plan(ops, pp, rank, v, paired_from)


def schedule_for(schedule: str, pp: int, rank: int, m: int, v: int = 1,
                 costs: Optional[StageCosts] = None) -> list[Op]:
    """``build_schedule``, with a split-backward schedule's weight gradients delayed as
    ``weight_grad_delays`` finds best for the ranks' op ``costs`` (none given: the default delays)."""
    if costs is None or schedule not in SPLIT_BACKWARD or v > 1:  # delays are tuned for one chunk a rank
        return build_schedule(schedule, pp, rank, m, v)
    return build_schedule(schedule, pp, rank, m, v, weight_grad_delays(schedule, pp, m, costs)[rank])


def check_ops(ops: list[Op], m: int, v: int) -> None:
    """Every (micro-batch, chunk) goes forward exactly once and backward exactly once, after its
    forward; in a split-backward schedule its weight gradient ``W`` also runs once, after its ``B``."""
    before = {"B": ("F", "forward"), "W": ("B", "backward")}
    seen: set[Op] = set()
    for op in ops:
        if op in seen:
            raise PipelineDeadlock(f"{op} appears twice")
        if op.kind in before and Op(before[op.kind][0], op.microbatch, op.chunk) not in seen:
            raise PipelineDeadlock(f"{op} runs before its {before[op.kind][1]}")
        seen.add(op)
    kinds = "FBW" if any(op.kind == "W" for op in ops) else "FB"
    expected = {Op(k, i, c) for k in kinds for i in range(m) for c in range(v)}
    if seen != expected:
        raise PipelineDeadlock(f"ops missing: {sorted(expected - seen)[:4]}, extra: {sorted(seen - expected)[:4]}")


CHANNELS = ("act", "grad")
"""Activations and gradients travel on separate communicators (``Topology``'s ``pp`` and ``pp_grad``
groups), each first-in first-out per pair of ranks: a send still waiting for its receiver holds up
later messages of its own kind only, never a gradient behind an activation or the reverse."""


def channel_of(message: Message) -> str:
    """The channel a message travels on: its kind (``CHANNELS``)."""
    return message.kind


def _match(plans: list[list[Step]], channel=channel_of) -> dict[tuple[int, int, str, int], int]:
    """For each (rank, step, 'send'/'recv', index-in-step): the step index of its partner on the peer,
    messages matched first-in first-out per ordered pair of ranks and channel, as NCCL does."""
    queues: dict[tuple[int, int, str, str], list[tuple[int, int, Message]]] = {}
    for rank, plan in enumerate(plans):
        for k, step in enumerate(plan):
            for j, t in enumerate(step.sends):
                queues.setdefault((rank, t.peer, channel(t.message), "send"), []).append((k, j, t.message))
            for j, t in enumerate(step.recvs):
                queues.setdefault((t.peer, rank, channel(t.message), "recv"), []).append((k, j, t.message))
    partner = {}
    for (src, dst, kind, side), items in queues.items():
        if side == "recv":
            continue
        recvs = queues.get((src, dst, kind, "recv"), [])
        if len(recvs) != len(items):
            raise PipelineDeadlock(f"rank {src} sends {len(items)} {kind} messages to rank {dst}, which receives "
                                   f"{len(recvs)}")
        for (ks, js, ms), (kr, jr, mr) in zip(items, recvs):
            if ms != mr:
                raise PipelineDeadlock(f"rank {src} sends {ms} to rank {dst} when it expects {mr}")
            partner[(src, ks, "send", js)], partner[(dst, kr, "recv", jr)] = kr, ks
    for (src, dst, kind, side), items in queues.items():
        if side == "recv" and (src, dst, kind, "send") not in queues:
            raise PipelineDeadlock(f"rank {dst} waits for {items[0][2]} that rank {src} never sends")
    return partner


def simulate(plans: list[list[Step]], channel=channel_of) -> list[float]:
    """Run every rank's plan with unit op costs; returns when each rank finished. Raises
    ``PipelineDeadlock`` naming what each stuck rank waits for. ``channel`` as in ``timeline``."""
    return [max((end for _, _, end in ops), default=0.0) for ops in timeline(plans, channel=channel)]


# Relative cost of each op when timing a plan: a whole backward is twice a forward (Narayanan et al.),
# split into an input-gradient half and a weight-gradient half of one forward each (Qi et al.).
UNIT_COSTS = {"F": 1.0, "B": 2.0, "B_input": 1.0, "W": 1.0}


@dataclass(frozen=True)
class StageCosts:
    """What ``weight_grad_delays`` schedules by, for each pipeline rank: ``ops``, the (forward, input
    gradient, weight gradient) time of one micro-batch, in any unit; ``held``, the activation memory
    one micro-batch in flight keeps there, in any unit (its blocks)."""

    ops: tuple[tuple[float, float, float], ...]
    held: tuple[float, ...]

    def tables(self) -> list[dict]:
        """The op costs as ``timeline`` takes them (a split backward's ``B`` is its input gradient)."""
        return [{"F": f, "B": b + w, "B_input": b, "W": w} for f, b, w in self.ops]


ATTENTION_BACKWARD = 2.5
"""The attention core's backward against its forward: recomputing the probabilities and four
products against two (flash attention's backward)."""


def stage_costs(blocks: Sequence[float], head: float, core_share: float, recomputed: float = 0.0) -> StageCosts:
    """Op costs of one micro-batch on each rank, in blocks' forwards, from its ``blocks`` and the
    last rank's LM ``head`` (its matrix work in blocks); ``recomputed`` is the share of a block's
    forward that its backward runs again (1 under full recompute, ``core_share`` under selective).

    A block's weight gradient is its linears' products again, its forward less the attention core
    (``core_share`` of it); its input gradient is the linears' products plus the core's backward. The
    fused cross-entropy computes the head's gradients inside its forward: three products there,
    nothing in the backward. On GPT 1.3B (H200, pp 2) this gives forward : input gradient : weight
    gradient = 1 : 1.21 : 0.86 per block, against 1 : 1.30 : 0.84 measured, and 5.25 blocks' forwards
    for the head against 4.9 measured (BENCHMARKS.md). A block held in half counts half a block, its
    core spread evenly (the split's own work model puts the core in the attention half: at most a
    few hundredths of a block apart)."""
    linears = 1.0 - core_share
    input_grad = linears + ATTENTION_BACKWARD * core_share + recomputed
    last = len(blocks) - 1
    ops = tuple((b + (3 * head if r == last else 0.0), b * input_grad, b * linears) for r, b in enumerate(blocks))
    return StageCosts(ops, tuple(float(b) for b in blocks))


@functools.lru_cache(maxsize=4096)
def _delayed(schedule: str, pp: int, rank: int, m: int, delay: int) -> tuple[tuple[Op, ...], tuple[Step, ...]]:
    """Rank ``rank``'s ops and plan under split-backward ``schedule`` with ``delay`` weight gradients
    waiting: built once for all the trials of ``weight_grad_delays``, which change one rank at a time."""
    ops = build_schedule(schedule, pp, rank, m, 1, delay)
    return tuple(ops), tuple(comm_plan(ops, pp, rank))


def modelled_step(schedule: str, pp: int, m: int, costs: StageCosts, delays: Optional[Sequence[int]] = None) -> float:
    """How long a step of split-backward ``schedule`` takes by ``timeline`` with ``costs``, each rank
    leaving ``delays[r]`` weight gradients waiting (None: the defaults)."""
    delays = range(pp) if delays is None else delays
    times = timeline([list(_delayed(schedule, pp, r, m, d)[1]) for r, d in enumerate(delays)], costs.tables())
    return max(end for rank_ops in times for _, _, end in rank_ops)


WEIGHT_GRAD_DELAY_GAIN = 0.005
"""Least shortening of the modelled step (a share of it) for which ``weight_grad_delays`` moves a rank's
delay off its default: below it, the op-cost model's own error (about 1%) could make it a loss."""

_DELAY_SEARCH_BUDGET = 100_000
"""Most ops simulated in all (ops of a step, all ranks', times about pp^2 trials) for which delays
are searched, about a second; a larger pipeline keeps the defaults rather than spend minutes of
simulation building its schedule."""


@functools.lru_cache(maxsize=256)
def weight_grad_delays(schedule: str, pp: int, m: int, costs: StageCosts) -> tuple[int, ...]:
    """How many weight gradients each rank of a split-backward schedule leaves waiting (default: rank
    ``r`` leaves ``r``), chosen by timing the plans with ``costs``.

    Why: a waiting weight gradient is work a rank can do when it would otherwise idle. The default
    fills 1F1B's cool-down when every stage costs the same, but with unequal stages the rank that
    bounds the step is not the one the default favours: at pp 2 under ZB-H2, GPT 1.3B's second rank
    (the head's heavy forward, and a start one forward late) ran a weight gradient before its last
    input gradient, so the first rank idled that long at the end (17 ms of a 1.04 s step). Leaving two
    waiting sends the last input gradient on first: the model predicts 2.5% off the step.

    Ranks are tried from the last to the first, each at every larger delay that keeps its activation
    memory (micro-batches in flight times ``costs.held``) within the most any rank holds by default,
    so no rank's peak passes the default's fullest; a rank keeps the delay that shortens the modelled
    step most, if by more than ``WEIGHT_GRAD_DELAY_GAIN``. Every rank computes the same answer from
    the same costs."""
    defaults = tuple(range(pp))
    if len(costs.ops) != pp or len(costs.held) != pp:
        raise ValueError(f"op costs for {len(costs.ops)} pipeline ranks, the pipeline has {pp}")
    if pp == 1 or 3 * pp * m * pp * pp > _DELAY_SEARCH_BUDGET:
        return defaults

    def held(r: int, delay: int) -> float:
        return max_live_activations(list(_delayed(schedule, pp, r, m, delay)[0])) * costs.held[r]

    cap = max(held(r, r) for r in range(pp))
    best, best_span = defaults, modelled_step(schedule, pp, m, costs, defaults)
    for r in reversed(range(pp)):
        pick, pick_span = best, best_span
        for d in range(best[r] + 1, m + 1):  # a delay of m or more leaves every W to the end
            if held(r, d) > cap:
                break  # micro-batches in flight never fall as the delay grows
            trial = best[:r] + (d,) + best[r + 1:]
            span = modelled_step(schedule, pp, m, costs, trial)
            if span < pick_span:
                pick, pick_span = trial, span
        if pick_span < best_span * (1 - WEIGHT_GRAD_DELAY_GAIN):
            best, best_span = pick, pick_span
    return best


def op_cost(op: Op, split: bool, costs: dict = UNIT_COSTS) -> float:
    return costs["B_input"] if op.kind == "B" and split else costs[op.kind]


def timeline(plans: list[list[Step]], costs: Union[dict, list[dict]] = UNIT_COSTS,
             channel=channel_of) -> list[list[tuple[Op, float, float]]]:
    """Each rank's ops with their start and end times, messages taking no time; ``costs`` is one table
    of op costs (``UNIT_COSTS``'s keys) for every rank, or a list of one per rank; ``channel`` maps a
    message to the stream it travels on (a constant one folds both channels into one stream).

    A rank posts step k's batch when its op of step k - 1 ends, as one sub-batch per channel
    (``CHANNELS``). A sub-batch begins once posted and once the rank's earlier sub-batches on that
    channel have completed (one communication stream per channel, in order, as NCCL runs them), and
    completes when it and every partner's sub-batch have begun. An op waits only for the sub-batch that
    carries its own input (``Step.needs``), posted in its step or, for a pair's second op, in the
    pair's: sends are left in flight (the executor does the same), so a ``W`` never waits for its
    ``B``'s gradient to be taken, and a pair's forward does not wait for its backward's gradient.
    Split-backward plans (holding ``W`` ops) cost ``B`` as the input-gradient half. Raises
    ``PipelineDeadlock`` naming what each stuck rank waits for, or a mismatch of message orders.
    """
    partner = _match(plans, channel)
    rank_costs = costs if isinstance(costs, list) else [costs] * len(plans)
    split = [splits_backward([step.op for step in plan if step.op is not None]) for plan in plans]
    posted: list[list[float]] = [[] for _ in plans]  # posted[r][k]: when rank r posted step k
    done: dict[tuple[int, int, str], float] = {}  # (rank, step, channel): when that sub-batch completed
    free = [0.0] * len(plans)  # when rank r's latest op ended
    out: list[list[tuple[Op, float, float]]] = [[] for _ in plans]
    ran = [0] * len(plans)  # steps whose op has run

    def sub_batches(r: int, k: int) -> dict[str, list[tuple[int, int]]]:
        """Channel -> (peer, the peer's step) of each transfer in rank r's step k."""
        step, by_channel = plans[r][k], {}
        for side, transfers in (("send", step.sends), ("recv", step.recvs)):
            for j, t in enumerate(transfers):
                by_channel.setdefault(channel(t.message), []).append((t.peer, partner[(r, k, side, j)]))
        return by_channel

    batches = [[sub_batches(r, k) for k in range(len(plan))] for r, plan in enumerate(plans)]
    channels = sorted({c for rank_batches in batches for step_batches in rank_batches for c in step_batches})
    queue = {(r, c): [k for k in range(len(plan)) if c in batches[r][k]]
             for r, plan in enumerate(plans) for c in channels}
    place = {(r, c, k): i for (r, c), steps in queue.items() for i, k in enumerate(steps)}
    head = dict.fromkeys(queue, 0)  # (rank, channel): index in queue of its next sub-batch to complete

    def started(r: int, k: int, stream: str) -> Optional[float]:
        """When rank r's sub-batch of step k began on its channel's stream: posted, and the one before
        it on that stream complete (None: not yet)."""
        if len(posted[r]) <= k:
            return None
        i = place[(r, stream, k)]
        if i == 0:
            return posted[r][k]
        before = done.get((r, queue[(r, stream)][i - 1], stream))
        return None if before is None else max(posted[r][k], before)

    def complete(r: int) -> bool:
        """Complete rank r's sub-batches that can, each channel in order; whether any did. A sub-batch
        completes once it and each partner's sub-batch have begun on their streams: a send or receive
        queued behind an unfinished one cannot meet its partner, as on an NCCL communicator."""
        progressed = False
        for stream in channels:
            steps, at = queue[(r, stream)], head[(r, stream)]
            while at < len(steps):
                k = steps[at]
                begins = [started(r, k, stream)] + [started(peer, pk, stream) for peer, pk in batches[r][k][stream]]
                if any(b is None for b in begins):
                    break
                done[(r, k, stream)] = max(begins)
                at += 1
                progressed = True
            head[(r, stream)] = at
        return progressed

    # (rank, message) -> (the rank's step that receives it, the peer it comes from)
    received_in = {(r, t.message): (k, t.peer) for r, plan in enumerate(plans)
                   for k, step in enumerate(plan) for t in step.recvs}

    def waits_for(r: int, k: int) -> list[str]:
        """What the op of rank r's step k still waits for: the sub-batch carrying its input."""
        need = plans[r][k].needs
        if need is None:
            return []
        at, peer = received_in[(r, need)]
        return [] if (r, at, channel(need)) in done else [f"recv {need} from rank {peer}"]

    while any(ran[r] < len(p) for r, p in enumerate(plans)):
        progressed = False
        for r, plan in enumerate(plans):
            while ran[r] < len(plan):
                k, step = ran[r], plan[ran[r]]
                if len(posted[r]) == k:  # posted as soon as the op before has run
                    posted[r].append(free[r])
                    progressed = True
                if waits_for(r, k):
                    break  # its input has not landed yet
                if step.op is not None:
                    need = step.needs
                    landed = [done[(r, received_in[(r, need)][0], channel(need))]] if need else []
                    start = max([free[r]] + landed)
                    free[r] = start + op_cost(step.op, split[r], rank_costs[r])
                    out[r].append((step.op, start, free[r]))
                ran[r] += 1
                progressed = True
        for r in range(len(plans)):
            while complete(r):
                progressed = True
        if not progressed:
            raise PipelineDeadlock("pipeline deadlock: " + "; ".join(
                f"rank {r} at step {ran[r]} ({p[ran[r]].op}) waits on {', '.join(waits_for(r, ran[r]))}"
                for r, p in enumerate(plans) if ran[r] < len(p)))
    return out


def bubble_of(times: list[list[tuple[Op, float, float]]]) -> float:
    """Idle time over busy time on the idlest rank, the step lasting until the last rank finishes.

    The measure of Narayanan et al. ((pp - 1) / m for 1F1B with costs 1 and 2), and the one the GPU
    benchmark reports from measured op times.
    """
    makespan = max(end for ops in times for _, _, end in ops)
    busy = [sum(end - start for _, start, end in ops) for ops in times]
    return max((makespan - b) / b for b in busy)
