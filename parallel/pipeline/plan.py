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

from parallel.pipeline.placement import V_SHAPED, holder_of, placement_of, stage_of
from parallel.pipeline.schedule import (INTERLEAVED, SPLIT_BACKWARD, Op, build_schedule, interleaved_warmup,
                                        max_live_activations, splits_backward, zero_bubble_v)


@dataclass(frozen=True)
class Message:
    """What travels between stages: ``act`` goes to virtual stage ``stage + 1``, ``grad`` to ``stage - 1``;
    ``back``: on a V's return leg (``boundary_message``), which has channels of its own."""

    kind: str
    microbatch: int
    stage: int
    back: bool = False

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


def boundary_message(kind: str, microbatch: int, stage: int, pp: int, placement: str = "loop") -> Message:
    """The message ``kind`` of ``microbatch`` leaving virtual ``stage``: in a V, a stage of the return leg
    (``stage >= pp``) sends on the back channels (``channel_of``)."""
    return Message(kind, microbatch, stage, back=placement == "v" and stage >= pp)


def op_io(op: Op, pp: int, rank: int, v: int, placement: str = "loop") -> tuple[Optional[Transfer], Optional[Transfer]]:
    """(what ``op`` receives, what it sends); ``None`` at the ends of the pipeline, and where the
    neighbouring stage is on this rank too (a V's turn: the executor hands it over in memory)."""
    if pp == 1 and v > 1:
        raise ValueError("virtual stages need pp > 1: with one rank, use a deeper single chunk instead")
    s, last = stage_of(pp, rank, op.chunk, placement), pp * v - 1
    if op.kind == "W":  # a weight gradient stays on its rank
        return None, None

    def transfer(stage: int, kind: str, source: int) -> Optional[Transfer]:
        if not 0 <= stage <= last:
            return None
        peer = holder_of(pp, stage, placement)[0]
        return None if peer == rank else Transfer(peer, boundary_message(kind, op.microbatch, source, pp, placement))

    if op.kind == "F":
        return transfer(s - 1, "act", s - 1), transfer(s + 1, "act", s)
    return transfer(s + 1, "grad", s + 1), transfer(s - 1, "grad", s)


def comm_plan(ops: list[Op], pp: int, rank: int, v: int = 1, paired_from: Optional[int] = None,
              placement: str = "loop") -> list[Step]:
    """Steps of rank ``rank``: one batched exchange before each op, or before each steady-state pair.

    Plain 1F1B exchanges before every op: the sends of the op before, the receive of the op next.
    Interleaved 1F1B (``paired_from`` = its warm-up length) runs its steady state as forward/backward
    pairs with one exchange between pairs, carrying both ops' sends and both next receives; per-op
    exchanges there would cross activations and gradients travelling between the same two ranks.
    ``placement`` says which rank holds which virtual stage (``placement.stage_of``).
    """
    steps: list[Step] = []
    pending: tuple[Transfer, ...] = ()
    for group in _groups(ops, paired_from):
        io = [op_io(op, pp, rank, v, placement) for op in group]
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


def plan_for(schedule: str, pp: int, rank: int, m: int, v: int = 1, costs: Optional[StageCosts] = None,
             placement: Optional[str] = None) -> tuple[list[Op], list[Step]]:
    """The op list of ``schedule`` for this rank and the communication steps that carry it out; with
    the ranks' op ``costs`` a split-backward schedule delays its weight gradients as
    ``weight_grad_delays`` finds best. ``placement``: where the stages are (default: where
    ``schedule`` puts them); an evaluation's ``forward_only`` runs on the training schedule's."""
    ops = schedule_for(schedule, pp, rank, m, v, costs)
    paired_from = interleaved_warmup(pp, rank, m, v) if schedule in INTERLEAVED else None
    return ops, comm_plan(ops, pp, rank, v, paired_from, placement or placement_of(schedule))


def schedule_for(schedule: str, pp: int, rank: int, m: int, v: int = 1,
                 costs: Optional[StageCosts] = None) -> list[Op]:
    """``build_schedule``, with a split-backward schedule's weight gradients delayed as
    ``weight_grad_delays`` finds best for the ranks' op ``costs`` (none given: the default delays); zb-v
    orders its ops by each virtual stage's costs (``costs`` then holds one entry per virtual stage)."""
    if schedule in V_SHAPED:
        return zero_bubble_v(pp, rank, m, v, None if costs is None else costs.ops, runs=v_orders_span)
    if not tunes_delays(schedule, pp, m, v, costs):
        return build_schedule(schedule, pp, rank, m, v)
    return build_schedule(schedule, pp, rank, m, v, weight_grad_delays(schedule, pp, m, costs)[rank])


def tunes_delays(schedule: str, pp: int, m: int, v: int = 1, costs: Optional[StageCosts] = None) -> bool:
    """Whether ``schedule_for`` may move weight-gradient delays off their defaults: a split-backward
    schedule of one chunk a rank (the delays are tuned for that), given op costs, small enough to search."""
    return (costs is not None and schedule in SPLIT_BACKWARD and schedule not in V_SHAPED and v == 1 and pp > 1
            and 3 * pp * m * pp * pp <= _DELAY_SEARCH_BUDGET)


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


def v_orders_span(pp: int, orders: Sequence[Sequence[tuple]], costs: Sequence[Sequence[float]]) -> Optional[float]:
    """When the last op of zb-v's ``orders`` (every rank's ops as (kind, micro-batch, chunk)) ends by
    ``timeline``, with each virtual stage's (F, B, W) ``costs``; None when their plans deadlock.

    Why: ``v_order`` finds the orders in a model where an op waits only for its own input, and the
    executor's batches per channel complete as a whole; the orders it would pick deadlock under
    unequal stages from pp 3 (``v_order``'s docstring), so ``v_orders`` checks each with this."""
    try:
        graph = EventGraph([RankEvents(comm_plan([Op(*op) for op in ops], pp, r, 2, placement="v"), r)
                            for r, ops in enumerate(orders)])
    except PipelineDeadlock:
        return None
    return graph.makespan([[{"F": f, "B": b + w, "B_input": b, "W": w}
                            for f, b, w in (costs[stage_of(pp, r, c, "v")] for c in (0, 1))] for r in range(pp)])


CHANNELS = ("act", "grad")
"""Activations and gradients travel on separate communicators (``Topology``'s ``pp`` and ``pp_grad``
groups), each first-in first-out per pair of ranks: a send still waiting for its receiver holds up
later messages of its own kind only, never a gradient behind an activation or the reverse."""

BACK_CHANNELS = ("act_back", "grad_back")
"""A V's return leg has two more (``pp_back``, ``pp_grad_back``): its ranks send activations both
ways, and on one in-order stream a first-leg activation sent early (the receiver takes it only after
some backwards) holds up the return-leg activation the sender's next forward waits for (the plan's
dry run deadlocks at pp 2 from 3 micro-batches)."""


def channels(placement: str) -> tuple[str, ...]:
    """The channels a placement's messages use."""
    return CHANNELS + BACK_CHANNELS if placement == "v" else CHANNELS


def channel_of(message: Message) -> str:
    """The channel a message travels on: its kind, on a V's return leg with ``_back`` (``channels``)."""
    return message.kind + "_back" if message.back else message.kind


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


def stage_costs(blocks: Sequence[float], head: float, core_share: float,
                recomputed: Optional[Sequence[float]] = None) -> StageCosts:
    """Op costs of one micro-batch on each rank, in blocks' forwards, from its ``blocks`` and the
    last rank's LM ``head`` (its matrix work in blocks); ``recomputed[r]`` is the forward work, in
    blocks, that rank ``r``'s backward runs again (its checkpointed blocks under full recompute, each
    block's ``core_share`` under selective; none when not given).

    A block's weight gradient is its linears' products again, its forward less the attention core
    (``core_share`` of it); its input gradient is the linears' products plus the core's backward. The
    fused cross-entropy computes the head's gradients inside its forward: three products there,
    nothing in the backward. On GPT 1.3B (H200, pp 2) this gives forward : input gradient : weight
    gradient = 1 : 1.21 : 0.86 per block, against 1 : 1.30 : 0.84 measured, and 5.25 blocks' forwards
    for the head against 4.9 measured (BENCHMARKS.md). A block held in half counts half a block, its
    core spread evenly (the split's own work model puts the core in the attention half: at most a
    few hundredths of a block apart)."""
    linears = 1.0 - core_share
    input_grad = linears + ATTENTION_BACKWARD * core_share
    recomputed = [0.0] * len(blocks) if recomputed is None else recomputed
    if len(recomputed) != len(blocks):
        raise ValueError(f"recomputed work for {len(recomputed)} stages, blocks for {len(blocks)}")
    last = len(blocks) - 1
    ops = tuple((b + (3 * head if r == last else 0.0), b * input_grad + again, b * linears)
                for r, (b, again) in enumerate(zip(blocks, recomputed)))
    return StageCosts(ops, tuple(float(b) for b in blocks))


@functools.lru_cache(maxsize=4096)
def _delayed(schedule: str, pp: int, rank: int, m: int, delay: int) -> tuple[int, "RankEvents"]:
    """Rank ``rank``'s micro-batches in flight at its fullest and its events, under split-backward
    ``schedule`` with ``delay`` weight gradients waiting: built once for all the trials of
    ``weight_grad_delays``, which change one rank at a time."""
    ops = build_schedule(schedule, pp, rank, m, 1, delay)
    return max_live_activations(ops), RankEvents(comm_plan(ops, pp, rank), rank)


def modelled_step(schedule: str, pp: int, m: int, costs: StageCosts, delays: Optional[Sequence[int]] = None) -> float:
    """How long a step of split-backward ``schedule`` takes by ``timeline`` with ``costs``, each rank
    leaving ``delays[r]`` weight gradients waiting (None: the defaults)."""
    delays = tuple(range(pp) if delays is None else delays)
    return _delayed_events(schedule, pp, m, delays).makespan(costs.tables())


@functools.lru_cache(maxsize=128)
def _delayed_events(schedule: str, pp: int, m: int, delays: tuple[int, ...]) -> "EventGraph":
    """The ``EventGraph`` of split-backward ``schedule`` with each rank's ``delays``: the planner times
    the same delays under the stage costs of many layouts."""
    return EventGraph([_delayed(schedule, pp, r, m, d)[1] for r, d in enumerate(delays)])


WEIGHT_GRAD_DELAY_GAIN = 0.005
"""Least shortening of the modelled step (a share of it) for which ``weight_grad_delays`` moves a rank's
delay off its default: below it, the op-cost model's own error (about 1%) could make it a loss."""

_DELAY_SEARCH_BUDGET = 100_000
"""Most ops simulated in all (ops of a step, all ranks', times about pp^2 trials) for which delays
are searched, about a second; a larger pipeline keeps the defaults rather than spend minutes of
simulation building its schedule."""


@functools.lru_cache(maxsize=4096)
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
    if not tunes_delays(schedule, pp, m, 1, costs):
        return defaults

    def held(r: int, delay: int) -> float:
        return _delayed(schedule, pp, r, m, delay)[0] * costs.held[r]

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


def timeline(plans: list[list[Step]], costs: Union[dict, list[dict]] = UNIT_COSTS,
             channel=channel_of) -> list[list[tuple[Op, float, float]]]:
    """Each rank's ops with their start and end times, messages taking no time; ``costs`` is one table
    of op costs (``UNIT_COSTS``'s keys) for every rank, or a list of one per rank (itself a table, or
    a list of one per chunk of the rank); ``channel`` maps a message to the stream it travels on (a
    constant one folds every channel into one stream).

    A rank posts step k's batch when its op of step k - 1 ends, as one sub-batch per channel
    (``CHANNELS``). A sub-batch begins once posted and once the rank's earlier sub-batches on that
    channel have completed (one communication stream per channel, in order, as NCCL runs them), and
    completes when it and every partner's sub-batch have begun: a send or receive queued behind an
    unfinished one cannot meet its partner, as on an NCCL communicator. An op waits only for the
    sub-batch that carries its own input (``Step.needs``), posted in its step or, for a pair's second
    op, in the pair's: sends are left in flight (the executor does the same), so a ``W`` never waits
    for its ``B``'s gradient to be taken, and a pair's forward does not wait for its backward's
    gradient. Split-backward plans (holding ``W`` ops) cost ``B`` as the input-gradient half. Raises
    ``PipelineDeadlock`` naming what each stuck rank waits for, or a mismatch of message orders.
    """
    rank_costs = costs if isinstance(costs, list) else [costs] * len(plans)
    return EventGraph([RankEvents(plan, r, channel) for r, plan in enumerate(plans)]).times(rank_costs)


COST_KEYS = tuple(UNIT_COSTS)


class RankEvents:
    """One rank's share of an ``EventGraph``: the events of its plan, each the later of at most two
    others of the rank (-1: none, time zero) plus an op's cost for an op's end (``cost``: 0, or one
    more than the op's index in ``COST_KEYS``, counted on from its chunk's, ``chunk * len(COST_KEYS)``),
    and its sub-batches in the order they meet each peer.

    Events: an op's start (after the rank's op before and the sub-batch carrying its input) and end;
    a sub-batch's beginning (posted as the op before ends, after the channel's sub-batch before) and
    completion, whose second wait ``EventGraph`` points at its partners' beginnings. Parallel lists
    rather than a record per op or transfer: see ``EventGraph``."""

    def __init__(self, plan: list[Step], rank: int, channel=channel_of):
        self.rank = rank
        self.first: list[int] = []
        self.second: list[int] = []
        self.cost: list[int] = []
        # (peer, channel, "send"/"recv") -> [completions, beginnings, messages] of its transfers, in order
        self.queues: dict[tuple[int, str, str], list[list]] = {}
        self.ops: list[Op] = []
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.steps: list[int] = []  # each op's step, what it waits on, and the peer sending that
        self.needs: list[Optional[Message]] = []
        self.senders: list[Optional[int]] = []
        self.unreceived: list[str] = []  # ops waiting on a message the plan never receives
        ahead = []  # (op index, its message) of ops waiting on a later step's receive: a deadlock
        split = splits_backward([step.op for step in plan if step.op is not None])
        last_end, latest, received = -1, {}, {}  # latest: channel -> (beginning, completion) of its last
        for k, step in enumerate(plan):
            this_step = {}
            for side, transfers in (("send", step.sends), ("recv", step.recvs)):
                for t in transfers:
                    c = channel(t.message)
                    if c not in this_step:
                        begin = self._event(last_end, latest[c][1] if c in latest else -1)
                        this_step[c] = latest[c] = (begin, self._event(begin, -1))
                    begin, done = this_step[c]
                    queue = self.queues.setdefault((t.peer, c, side), [[], [], []])
                    queue[0].append(done)
                    queue[1].append(begin)
                    queue[2].append(t.message)
                    if side == "recv":
                        received[t.message] = (done, t.peer)
            if step.op is not None:
                landed, peer = received.get(step.needs, (-1, None)) if step.needs is not None else (-1, None)
                if step.needs is not None and peer is None:  # received later, if at all: wired below
                    ahead.append((len(self.starts), step.needs))
                key = "B_input" if step.op.kind == "B" and split else step.op.kind
                self.starts.append(self._event(last_end, landed))
                last_end = self._event(self.starts[-1], -1,
                                       cost=1 + step.op.chunk * len(COST_KEYS) + COST_KEYS.index(key))
                self.ends.append(last_end)
                self.ops.append(step.op)
                self.steps.append(k)
                self.needs.append(step.needs)
                self.senders.append(peer)
        for i, need in ahead:
            if need in received:
                self.second[self.starts[i]], self.senders[i] = received[need]
            else:
                self.unreceived.append(f"rank {rank} at step {self.steps[i]} ({self.ops[i]}) needs {need}, which "
                                       "the rank never receives")

    def _event(self, a: int, b: int, cost: int = 0) -> int:
        self.first.append(a)
        self.second.append(b)
        self.cost.append(cost)
        return len(self.cost) - 1


class EventGraph:
    """``timeline``'s events for all ranks, ordered once so that any op costs can then be timed in one
    pass. Messages are matched first-in first-out per ordered pair of ranks and channel, as NCCL does;
    a sub-batch with several partners completes through a chain of events.

    Why separate from the costs: ``weight_grad_delays`` and the planner time the same plans under many
    sets of stage costs, and the waits depend on the plans alone (the planner also reuses a rank's
    events across the delays of the others). Why flat lists of integers: a graph holds thousands of
    events, and a container for each kept Python's cycle collector busier than the timing itself."""

    def __init__(self, ranks: list[RankEvents]):
        self.ranks = ranks
        self.first, self.second, self.cost, self.offsets = [], [], [], []
        self.chunks = 1 + max((op.chunk for part in ranks for op in part.ops), default=0)
        for part in ranks:
            at, shift = len(self.cost), part.rank * self.chunks * len(COST_KEYS)
            self.offsets.append(at)
            self.first += [a + at if a >= 0 else -1 for a in part.first]
            self.second += [b + at if b >= 0 else -1 for b in part.second]
            self.cost += [c + shift if c else 0 for c in part.cost]
        partners: dict[int, set[int]] = {}  # completion -> its partners' beginnings
        for src, part in enumerate(ranks):
            for (dst, c, side), (dones, begins, messages) in part.queues.items():
                if side == "recv":
                    continue
                r_dones, r_begins, expected = ranks[dst].queues.get((src, c, "recv"), [[], [], []])
                if len(expected) != len(messages):
                    raise PipelineDeadlock(f"rank {src} sends {len(messages)} {c} messages to rank {dst}, which "
                                           f"receives {len(expected)}")
                if messages != expected:
                    sent, wanted = next((s, e) for s, e in zip(messages, expected) if s != e)
                    raise PipelineDeadlock(f"rank {src} sends {sent} to rank {dst} when it expects {wanted}")
                at_src, at_dst = self.offsets[src], self.offsets[dst]
                for done_s, begin_s, done_r, begin_r in zip(dones, begins, r_dones, r_begins):
                    partners.setdefault(done_s + at_src, set()).add(begin_r + at_dst)
                    partners.setdefault(done_r + at_dst, set()).add(begin_s + at_src)
        for dst, part in enumerate(ranks):
            for (src, c, side), (_, _, messages) in part.queues.items():
                if side == "recv" and (dst, c, "send") not in ranks[src].queues:
                    raise PipelineDeadlock(f"rank {dst} waits for {messages[0]} that rank {src} never sends")
            if part.unreceived:
                raise PipelineDeadlock(part.unreceived[0])
        for done, starts in partners.items():  # complete once every partner has begun too
            starts = sorted(starts)
            later = starts[0]
            for b in starts[1:]:
                later = self._event(later, b)
            self.second[done] = later
        self._costed = sorted(set(self.cost) - {0})
        self.order = self._order()
        if self.order is None:  # some events wait on themselves: a deadlock if an op is among them
            self.order = self._resolvable()
            self._check_ops_start()

    def _event(self, a: int, b: int) -> int:
        self.first.append(a)
        self.second.append(b)
        self.cost.append(0)
        return len(self.cost) - 1

    def _order(self) -> Optional[list[int]]:
        """Every event after the ones it waits for (depth first from each in turn); None if an event
        waits, directly or not, on itself."""
        first, second = self.first, self.second
        state = bytearray(len(first))  # 0 unseen, 1 on the path, 2 ordered
        order = []
        for root in range(len(first)):
            if state[root]:
                continue
            path = [root]
            while path:
                e = path[-1]
                state[e] = 1
                a, b = first[e], second[e]
                if a >= 0 and state[a] != 2:
                    if state[a] == 1:
                        return None
                    path.append(a)
                elif b >= 0 and state[b] != 2:
                    if state[b] == 1:
                        return None
                    path.append(b)
                else:
                    state[e] = 2
                    order.append(e)
                    path.pop()
        return order

    def _resolvable(self) -> list[int]:
        """The events that do not wait on themselves, each after what it waits for (sweeps until none
        is added: slower than ``_order``, for graphs it refuses)."""
        resolved, order, grew = bytearray(len(self.cost)), [], True
        while grew:
            grew = False
            for e, (a, b) in enumerate(zip(self.first, self.second)):
                if not resolved[e] and (a < 0 or resolved[a]) and (b < 0 or resolved[b]):
                    resolved[e] = grew = True
                    order.append(e)
        return order

    def _check_ops_start(self) -> None:
        """Raises ``PipelineDeadlock`` naming, for each stuck rank, the message its first op that can
        never start waits for; sends left waiting after a rank's last op hold up nothing."""
        resolved, stuck = set(self.order), []
        for part, at in zip(self.ranks, self.offsets):
            i = next((i for i, start in enumerate(part.starts) if start + at not in resolved), None)
            if i is not None:
                stuck.append(f"rank {part.rank} at step {part.steps[i]} ({part.ops[i]}) waits on recv "
                             f"{part.needs[i]} from rank {part.senders[i]}")
        if stuck:
            raise PipelineDeadlock("pipeline deadlock: " + "; ".join(stuck))

    def _event_times(self, rank_costs: list) -> list[float]:
        table = [0.0] * (1 + len(rank_costs) * self.chunks * len(COST_KEYS))
        for index in self._costed:  # a table need only hold the kinds of ops its rank runs
            rank, rest = divmod(index - 1, self.chunks * len(COST_KEYS))
            chunk, key = divmod(rest, len(COST_KEYS))
            costs = rank_costs[rank]
            table[index] = (costs[chunk] if isinstance(costs, (list, tuple)) else costs)[COST_KEYS[key]]
        t = [0.0] * (len(self.cost) + 1)  # t[-1]: a missing wait's zero
        first, second, cost = self.first, self.second, self.cost
        for e in self.order:
            x, y = t[first[e]], t[second[e]]
            t[e] = (x if x >= y else y) + table[cost[e]]
        return t

    def times(self, rank_costs: list) -> list[list[tuple[Op, float, float]]]:
        """Each rank's ops with start and end times under ``rank_costs`` (one table per rank, or a list of
        one per chunk of the rank)."""
        t = self._event_times(rank_costs)
        return [[(op, t[start + at], t[end + at]) for op, start, end in zip(part.ops, part.starts, part.ends)]
                for part, at in zip(self.ranks, self.offsets)]

    def makespan(self, rank_costs: list) -> float:
        """When the last op ends under ``rank_costs``."""
        t = self._event_times(rank_costs)
        return max((t[part.ends[-1] + at] for part, at in zip(self.ranks, self.offsets) if part.ends), default=0.0)


def bubble_of(times: list[list[tuple[Op, float, float]]]) -> float:
    """Idle time over busy time on the idlest rank, the step lasting until the last rank finishes.

    The measure of Narayanan et al. ((pp - 1) / m for 1F1B with costs 1 and 2), and the one the GPU
    benchmark reports from measured op times.
    """
    makespan = max(end for ops in times for _, _, end in ops)
    busy = [sum(end - start for _, start, end in ops) for ops in times]
    return max((makespan - b) / b for b in busy)
