"""Pipeline schedules as data: exact op orders, activation bounds, and a deadlock-free communication plan."""

import itertools
import re
from pathlib import Path

import pytest

from parallel.pipeline.partition import (HALF_BLOCK_GAIN, balanced_split, rank_work, resolve_split, stage_layers,
                                         stage_parts)
from parallel.pipeline.placement import V_SHAPED, holder_of, placement_of
from parallel.pipeline.plan import (UNIT_COSTS, PipelineDeadlock, bubble_of, check_ops, comm_plan, plan_for,
                                    simulate, timeline)
from parallel.pipeline.schedule import (Op, bubble_fraction, build_schedule, default_schedule, interleaved_1f1b,
                                        max_live_activations, one_f_one_b, schedule_problem)


def seq(text: str) -> list[Op]:
    """'F0 F1 B0 F1.1' -> ops; '.c' is the model chunk."""
    ops = []
    for tok in text.split():
        mb, _, chunk = tok[1:].partition(".")
        ops.append(Op(tok[0], int(mb), int(chunk or 0)))
    return ops


# Written out by hand from the definitions (PipeDream-flush; Narayanan et al. 2021 for interleaved).
EXPECTED = {
    ("1f1b", 4, 6, 1): [
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5",
    ],
    ("1f1b", 3, 2, 1): ["F0 F1 B0 B1", "F0 F1 B0 B1", "F0 B0 F1 B1"],
    ("1f1b", 2, 3, 1): ["F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2"],
    ("gradient_accumulation", 2, 2, 1): ["F0 B0 F1 B1", "F0 B0 F1 B1"],
    ("interleaved_1f1b", 2, 4, 2): [
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3",
        "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3",
    ],
    ("interleaved_1f1b", 2, 2, 2): ["F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1"] * 2,
    # interleaved 1F1B's order, each B's W kept waiting while more than the rank's index wait
    ("interleaved_zb", 2, 4, 2): [
        "F0 F1 F0.1 F1.1 F2 B0.1 W0.1 F3 B1.1 W1.1 F2.1 B0 W0 F3.1 B1 W1 B2.1 W2.1 B3.1 W3.1 B2 W2 B3 W3",
        "F0 F1 F0.1 B0.1 F1.1 B1.1 W0.1 F2 B0 W1.1 F3 B1 W0 F2.1 B2.1 W1 F3.1 B3.1 W2.1 B2 W3.1 B3 W2 W3",
    ],
}


@pytest.mark.parametrize("key", list(EXPECTED), ids=lambda k: "-".join(map(str, k)))
def test_op_sequence_matches_definition(key):
    name, pp, m, v = key
    for rank, text in enumerate(EXPECTED[key]):
        assert build_schedule(name, pp, rank, m, v) == seq(text), f"rank {rank}"


PAGE_DIAGRAM = re.compile(r"```\npp=(\d+), m=(\d+)(?:, v=(\d+))?, ([\w-]+)[^\n]*\n(.*?)```", re.S)


def test_the_pipeline_pages_diagrams_are_the_schedules_built():
    """Each op order docs/pipeline.md draws ("pp=2, m=4, zb-h2" over "rank 0: F0 F1 ...") is what
    ``build_schedule`` returns for that rank: a reader takes the page's orders as the schedules'.
    (Planted: two ops of the page's zb-h2 rank 1 swapped.)"""
    page = (Path(__file__).resolve().parent.parent / "docs" / "pipeline.md").read_text(encoding="utf-8")
    drawn = PAGE_DIAGRAM.findall(page)
    assert {name for *_, name, _ in drawn} >= {"1f1b", "zb-h1", "zb-h2", "interleaved_zb", "zb-v"}
    for pp, m, v, name, body in drawn:
        chunks = int(v) if v else 2 if name in V_SHAPED else 1
        for line in body.strip().splitlines():
            rank, _, ops = line.partition(":")
            built = build_schedule(name, int(pp), int(rank.split()[1]), int(m), chunks)
            assert built == seq(ops), (name, line)


CASES = [("1f1b", pp, m, 1) for pp in (1, 2, 3, 4, 8) for m in (1, 2, 3, pp, 2 * pp, 2 * pp + 1, 17)]
CASES += [("gradient_accumulation", pp, m, 1) for pp in (1, 2, 4) for m in (1, 3, 5)]
CASES += [("interleaved_1f1b", pp, k * pp, v) for pp in (2, 3, 4, 8) for k in (1, 2, 3) for v in (2, 3, 4)]
# micro-batch counts that are not a multiple of pp (odd ones among them): all forwards first
CASES += [("interleaved_1f1b", pp, m, v) for pp in (2, 3, 4, 8) for m in (1, pp + 1, 2 * pp + 1) for v in (2, 3)]
CASES += [("interleaved_zb", pp, m, v) for pp in (2, 3, 4, 8) for m in (1, pp, pp + 1, 2 * pp, 3 * pp)
          for v in (2, 3, 4)]


@pytest.mark.parametrize("name,pp,m,v", CASES)
def test_every_op_once_and_plan_runs(name, pp, m, v):
    plans = []
    for rank in range(pp):
        ops, plan = plan_for(name, pp, rank, m, v)
        check_ops(ops, m, v)
        plans.append(plan)
    finished = simulate(plans)
    assert len(finished) == pp
    simulate(plans, channel=lambda message: "one")  # these need no second communicator


@pytest.mark.parametrize("pp,m,v", [(1, 3, 1), (2, 3, 1), (4, 5, 2), (3, 7, 3)])
def test_forward_only_plan_runs(pp, m, v):
    plans = [plan_for("forward_only", pp, r, m, v)[1] for r in range(pp)]
    simulate(plans)
    assert build_schedule("forward_only", 2, 0, 3, 2) == seq("F0 F1 F0.1 F1.1 F2 F2.1")


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 8, 17])
def test_1f1b_live_activations_bounded_by_pp_minus_rank(pp, m):
    for rank in range(pp):
        assert max_live_activations(one_f_one_b(pp, rank, m)) == min(pp - rank, m)


def test_interleaved_live_activations_bound():
    pp, v, m = 4, 2, 16
    for rank in range(pp):
        live = max_live_activations(interleaved_1f1b(pp, rank, m, v))
        assert live <= (pp - rank - 1) * 2 + (v - 1) * pp + 1


def test_live_activations_weigh_each_chunk_by_its_own_bytes():
    """With chunk weights the peak is the most of the summed weights of the chunks in flight, which
    need not be where the most chunks are (planted: every chunk at the first's weight, or at the
    average); a split backward frees a chunk at its W, not its B."""
    ops = [Op("F", 0, 0), Op("F", 0, 1), Op("F", 1, 0), Op("B", 0, 1), Op("F", 1, 1), Op("B", 1, 1),
           Op("B", 0, 0), Op("B", 1, 0)]
    assert max_live_activations(ops) == 3
    assert max_live_activations(ops, [1.0, 10.0]) == 12.0  # F0.1 and F1.1 never in flight together
    assert max_live_activations(ops, [10.0, 1.0]) == 21.0
    split = [Op("F", 0, 0), Op("F", 0, 1), Op("B", 0, 1), Op("B", 0, 0), Op("F", 1, 1), Op("W", 0, 1), Op("W", 0, 0)]
    assert max_live_activations(split, [1.0, 10.0]) == 21.0


@pytest.mark.parametrize("name, v", [("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("interleaved_1f1b", 2),
                                     ("interleaved_1f1b", 3), ("interleaved_zb", 2)])
def test_the_fullest_points_kept_give_every_weighting_its_peak(name, v):
    """``max_live_activations`` weighs only the count vectors no other point of the schedule matches
    or exceeds in every chunk (what the planner keeps per schedule): the peak must equal a scan of
    every op under any chunk weights, up to rounding (planted: keeping only the vector of most chunks
    in flight)."""
    import random
    rng = random.Random(7)
    for pp, m in ((2, 8), (4, 8), (4, 12)):
        for rank in range(pp):
            ops = build_schedule(name, pp, rank, m, v)
            done = "W" if any(op.kind == "W" for op in ops) else "B"
            for _ in range(5):
                weights = [rng.choice([0.0, 1.0, rng.random() * 10]) for _ in range(v)]
                live = peak = 0.0
                for op in ops:
                    live += weights[op.chunk] * ((op.kind == "F") - (op.kind == done))
                    peak = max(peak, live)
                assert max_live_activations(ops, weights) == pytest.approx(peak), (pp, m, rank, weights)


def test_simulator_catches_a_deadlock():
    # Interleaved 1F1B with one exchange per op (instead of per steady-state pair) deadlocks.
    pp, m, v = 2, 4, 2
    naive = [comm_plan(build_schedule("interleaved_1f1b", pp, r, m, v), pp, r, v) for r in range(pp)]
    with pytest.raises(PipelineDeadlock, match="rank 0 at step .* waits on"):
        simulate(naive)
    # Rank 1 waits for activation 1 before sending gradient 0; rank 0 sends activation 1 only after
    # the backward that needs gradient 0.
    plans = [comm_plan(seq("F0 B0 F1 B1"), 2, 0), comm_plan(seq("F0 F1 B0 B1"), 2, 1)]
    with pytest.raises(PipelineDeadlock, match="rank 0 at step .* waits on recv grad"):
        simulate(plans)


def test_a_pair_runs_its_forward_while_its_backwards_gradient_travels():
    """Interleaved 1F1B, pp 2, 8 micro-batches, GPT 1.3B's op times (ms, per chunk, two chunks a rank):
    rank 0's first steady-state pair is F2 with B0 of its second chunk, whose gradient comes from
    rank 1 late. F2 needs nothing and runs at once; B waits for its gradient alone. (Planted: every
    op of a step waited for all of its step's receives, as before; F2 then started only once that
    gradient had landed, 39 ms of idle measured on H200s.)"""
    costs = [{"F": 19.85, "B": 42.9}, {"F": 23.85, "B": 36.8}]
    plans = [plan_for("interleaved_1f1b", 2, r, 8, 2)[1] for r in range(2)]
    steps = {step.op: step for step in plans[0]}
    assert steps[Op("F", 2)].needs is None and steps[Op("B", 0, 1)].needs.kind == "grad"
    times = timeline(plans, costs)
    start = {op: begin for op, begin, _ in times[0]}
    grad_sent = next(end for op, _, end in times[1] if op == Op("B", 0, 1))
    assert start[Op("F", 2)] < grad_sent <= start[Op("B", 0, 1)]


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_interleaved_zero_bubble_idles_least_within_interleaved_memory(pp):
    """With equal op costs interleaved_zb idles (2 pp - 3) / (3 v m) (``bubble_fraction``): half of
    ZB-H1 at pp 2 with two chunks, below interleaved 1F1B and ZB-H1 at every depth. No rank holds more
    chunk activations than interleaved 1F1B's first rank, and the plan runs on one stream too. Each
    B's gradient leaves in the exchange before its waiting W runs. (Planted: W grouped with the pair
    before it, so its gradient waited for the W: the bubble grew; the bubble formula with ZB-H1's
    third.)"""
    for v in (2, 3):
        for m in (2 * pp, 4 * pp):
            unit = {"F": 1 / v, "B": 2 / v, "B_input": 1 / v, "W": 1 / v}
            plans = [plan_for("interleaved_zb", pp, r, m, v)[1] for r in range(pp)]
            bubble = bubble_of(timeline(plans, unit))
            assert bubble == pytest.approx(bubble_fraction(pp, m, v, "interleaved_zb")) == pytest.approx(
                (2 * pp - 3) / (3 * v * m))
            for other, chunks in (("interleaved_1f1b", v), ("zb-h1", 1)):
                base = [plan_for(other, pp, r, m, chunks)[1] for r in range(pp)]
                assert bubble < bubble_of(timeline(base, unit if chunks == v else UNIT_COSTS)), other
            live = [max_live_activations(build_schedule("interleaved_zb", pp, r, m, v)) for r in range(pp)]
            assert max(live) <= max_live_activations(build_schedule("interleaved_1f1b", pp, 0, m, v))
            timeline(plans, channel=lambda message: "one")
    plan = plan_for("interleaved_zb", 2, 1, 4, 2)[1]
    at = next(k for k, step in enumerate(plan) if step.op == Op("W", 0, 1))
    assert [t.message.kind for t in plan[at].sends] == ["grad"]  # B1.1's gradient, sent before W0.1 runs


def test_simulator_catches_mismatched_orders():
    plans = [comm_plan(seq("F0 F1 B0 B1"), 2, 0), comm_plan(seq("F1 B1 F0 B0"), 2, 1)]
    with pytest.raises(PipelineDeadlock, match="expects"):
        simulate(plans)


def test_check_ops_rejects_backward_before_forward():
    with pytest.raises(PipelineDeadlock, match="before its forward"):
        check_ops(seq("B0 F0"), 1, 1)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        build_schedule("gpipe", 2, 0, 4)
    with pytest.raises(ValueError, match="outside"):
        build_schedule("1f1b", 2, 2, 4)


def test_bubble_theory():
    assert bubble_fraction(2, 8) == pytest.approx(1 / 8)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 16)


def test_balanced_split_takes_the_heads_work_off_the_last_rank():
    """GPT 1.3B's head is 1.75 blocks of work: pp 2 holds 13 and 11 blocks (13 against 12.75) rather
    than 12 and 12 (12 against 13.75); interleaved, the last rank's chunks lose the block and the head
    sits in the lighter last chunk; a cost below half a block moves nothing."""
    assert balanced_split(24, 2, 1, head_cost=1.75) == [13, 11]
    assert balanced_split(24, 2, 2, head_cost=1.75) == [7, 6, 6, 5]
    assert balanced_split(24, 4, 1, head_cost=1.75) == [6, 7, 6, 5]
    assert balanced_split(32, 4, 1, head_cost=0.4) == [8, 8, 8, 8]
    assert balanced_split(4, 2, 1, head_cost=40.0) == [3, 1]  # every stage keeps a block
    for layers, pp, v, cost in [(40, 2, 1, 1.75), (40, 4, 2, 3.2), (40, 3, 1, 0.9), (20, 8, 1, 2.5)]:
        split = balanced_split(layers, pp, v, cost)
        loads = [sum(split[c * pp + r] for c in range(v)) + (cost if r == pp - 1 else 0) for r in range(pp)]
        best = min(max(k + (cost if r == pp - 1 else 0) for r, k in enumerate(counts))
                   for counts in _compositions(layers, pp, v))
        assert sum(split) == layers and max(loads) == pytest.approx(best), (pp, v, cost, split)


def _compositions(total: int, parts: int, minimum: int):
    """Every way to write ``total`` as ``parts`` ordered counts of at least ``minimum``."""
    if parts == 1:
        yield (total,)
        return
    for first in range(minimum, total - minimum * (parts - 1) + 1):
        for rest in _compositions(total - first, parts - 1, minimum):
            yield (first, *rest)


def _rank_work(split, share: float, head: float) -> list[float]:
    """Each stage's work in blocks (one chunk a rank): attention halves weigh ``share``, MLP halves the
    rest, the last stage adds the head."""
    weights = [share, 1 - share] * int(sum(split))
    bounds = [0, *itertools.accumulate(int(2 * k) for k in split)]
    return [sum(weights[a:b]) + (head if r == len(split) - 1 else 0) for r, (a, b) in enumerate(zip(bounds, bounds[1:]))]


def test_balanced_split_cuts_blocks_in_half_where_that_pays():
    """Given the attention half's share, the default split may end counts in halves: GPT 1.3B at pp 4
    gets [6.5, 6.5, 6.5, 4.5] (6.57 blocks of work at most against [6, 7, 6, 5]'s 7; 7.0% faster on
    H200s) and GPT 6.7B at pp 2 [16.5, 15.5] (16.56 against 16.94; 3.6% faster at tp 2 x pp 2), while
    at pp 2 GPT 1.3B keeps [13, 11] (the best half split, 13.32, is worse; it ran 3.6% slower). On small
    cases the result is the least busiest-rank work over every split in halves, or the whole-block
    split where halves gain less than HALF_BLOCK_GAIN (planted: filling stages to the limit from the
    back left [0.5, 0.5, ...] for 105 layers on 35 stages; the bisection off by one limit; halves taken
    for any gain; the attention and MLP halves' weights swapped)."""
    assert balanced_split(24, 4, 1, 1.753, 0.4286) == [6.5, 6.5, 6.5, 4.5]
    assert balanced_split(32, 2, 1, 0.944, 0.385) == [16.5, 15.5]
    assert balanced_split(24, 2, 1, 1.753, 0.4286) == [13, 11]
    assert balanced_split(38, 2, 1, 1.12, 0.8) == [20, 18]  # halves gain 1% to within rounding: not more
    deep = balanced_split(105, 35, 1, 1.0, 0.4)
    assert max(_rank_work(deep, 0.4, 1.0)) == pytest.approx(3.6) and min(deep) >= 2
    for layers, pp, head, share in [(6, 2, 0.0, 0.4), (7, 3, 1.75, 0.43), (8, 4, 1.2, 0.38), (9, 3, 0.3, 0.45),
                                    (6, 4, 2.5, 0.43), (10, 3, 0.9, 0.3), (5, 5, 0.6, 0.43),
                                    (3, 2, 1.65, 0.27), (6, 4, 0.57, 0.31),  # attention and MLP told apart
                                    (64, 2, 0.5, 0.385)]:  # halves would gain 0.4%: whole
        split = balanced_split(layers, pp, 1, head, share)
        best_whole = min(max(_rank_work(c, share, head)) for c in _compositions(layers, pp, 1))
        best_half = min(max(_rank_work([k / 2 for k in c], share, head)) for c in _compositions(2 * layers, pp, 1))
        got = max(_rank_work(split, share, head))
        if best_half < best_whole * (1 - HALF_BLOCK_GAIN):
            assert got == pytest.approx(best_half), (layers, pp, head, share, split)
        else:
            assert all(float(k).is_integer() for k in split) and got == pytest.approx(best_whole), split
    with pytest.raises(ValueError, match="attention_share"):
        balanced_split(24, 2, 1, 1.0, 1.0)
    with pytest.raises(ValueError, match="head_cost"):
        balanced_split(24, 2, 1, float("nan"), 0.4)


def test_interleaved_split_cuts_blocks_in_half_where_the_busiest_chunk_gains():
    """With several chunks a rank the split may end counts in halves where that lowers the busiest
    chunk's work by more than HALF_BLOCK_GAIN and leaves the busiest rank no busier: GPT 1.3B at pp 2
    with two chunks a rank gets [6.5, 6.5, 6.5, 4.5] (6.57 blocks at most a chunk against 7.0, ranks
    12.86 and 12.89 against 13.0 and 12.75; 2.0-3.7% faster under interleaved_zb on H100s and
    H200s). On small cases a split with halves has the least busiest-chunk work of any split in
    halves, and otherwise it is the whole-block one (planted: halves taken without the rank check,
    for any gain, or balanced over ranks rather than chunks)."""
    assert balanced_split(24, 2, 2, 1.753, 0.4286) == [6.5, 6.5, 6.5, 4.5]
    assert balanced_split(24, 2, 2, 1.753) == [7, 6, 6, 5]  # without the halves' weights: whole blocks
    taken = 0
    for layers, pp, v, head, share in [(8, 2, 2, 1.75, 0.43), (12, 2, 2, 1.0, 0.43), (9, 2, 3, 0.6, 0.4),
                                       (10, 2, 2, 0.0, 0.43), (7, 3, 2, 1.2, 0.38), (12, 3, 2, 2.5, 0.45),
                                       (8, 2, 2, 0.2, 0.43), (16, 2, 2, 0.5, 0.385),
                                       (32, 2, 2, 0.5, 0.43), (68, 4, 2, 0.3, 0.385)]:  # gains 0.9%: whole
        split, whole = balanced_split(layers, pp, v, head, share), balanced_split(layers, pp, v, head)
        works, whole_works = _rank_work(split, share, head), _rank_work(whole, share, head)
        busiest_rank = lambda w: max(sum(w[r::pp]) for r in range(pp))  # noqa: E731
        if all(float(k).is_integer() for k in split):
            assert split == whole, (layers, pp, v, head, share, split)
            continue
        taken += 1
        best = min(max(_rank_work([k / 2 for k in c], share, head)) for c in _compositions(2 * layers, pp * v, 1))
        assert max(works) == pytest.approx(best), (layers, pp, v, head, share, split)
        assert max(works) < max(whole_works) * (1 - HALF_BLOCK_GAIN), split
        assert busiest_rank(works) <= busiest_rank(whole_works) + 1e-9, split
    assert 2 <= taken < 8


def test_even_split_puts_remainder_in_the_middle():
    assert balanced_split(10, 4) == [2, 3, 3, 2]
    assert balanced_split(8, 4) == [2, 2, 2, 2]
    assert sum(balanced_split(105, 35)) == 105


def test_user_split_validated_and_mapped_to_chunks():
    assert resolve_split(6, 2, 1, [2, 4]) == [2, 4]
    with pytest.raises(ValueError, match="pipeline_split: .* summing to model.num_layers 6"):
        resolve_split(6, 2, 1, [2, 3])
    with pytest.raises(ValueError, match="4 positive"):
        resolve_split(6, 2, 2, [3, 3])
    with pytest.raises(ValueError, match="2 positive"):  # an entry past the stages would hold blocks no rank runs
        resolve_split(6, 2, 1, [2, 2, 2])
    with pytest.raises(ValueError, match="positive"):
        resolve_split(6, 2, 1, [0, 6])
    split = resolve_split(8, 2, 2)
    assert [list(stage_layers(split, 2, r, c)) for c in range(2) for r in range(2)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="cannot fill"):
        balanced_split(3, 4)
    with pytest.raises(ValueError, match="cannot fill"):
        resolve_split(3, 2, 2)


def test_a_split_may_cut_blocks_in_half():
    assert resolve_split(24, 2, 1, [12.5, 11.5]) == [12.5, 11.5]
    assert (stage_layers([12.5, 11.5], 2, 0), stage_parts([12.5, 11.5], 2, 0)) == (range(0, 13), {12: ("attention",)})
    assert (stage_layers([12.5, 11.5], 2, 1), stage_parts([12.5, 11.5], 2, 1)) == (range(12, 24), {12: ("mlp",)})
    assert stage_parts([13, 11], 2, 1) == {} and stage_parts([12.0, 12], 2, 1) == {}  # a whole count may be a float
    # two chunks a rank, in virtual-stage order: block 0's halves on ranks 0 and 1, block 3's too
    split = [0.5, 1.5, 1.5, 0.5]
    held = [(list(stage_layers(split, 2, r, c)), stage_parts(split, 2, r, c)) for c in range(2) for r in range(2)]
    assert held == [([0], {0: ("attention",)}), ([0, 1], {0: ("mlp",)}), ([2, 3], {3: ("attention",)}),
                    ([3], {3: ("mlp",)})]
    # a stage of one MLP half and the next block's attention half
    assert stage_parts([0.5, 1, 2.5], 3, 1) == {0: ("mlp",), 1: ("attention",)}
    for bad in ([12.25, 11.75], [12.5, 12.5], [True, 23], ["12", 12]):
        with pytest.raises(ValueError, match="whole or halves"):
            resolve_split(24, 2, 1, bad)


def test_bubble_without_pipelining_is_every_other_stage():
    assert bubble_fraction(4, 8, schedule="gradient_accumulation") == 3.0


# --- schedule.py ----------------------------------------------------------------------------------

def test_sizes_and_delays_out_of_range_are_refused():
    """No micro-batches is a configuration error, not an empty step; a negative weight-gradient delay
    is refused rather than run as 0; interleaved_zb needs two chunks a rank. (Planted: ``m < 1``
    loosened to ``m < 0``; ``delay < 0`` to ``delay < -1``; ``v < 2`` to ``v < 1``.)"""
    for name in ("1f1b", "gradient_accumulation", "zb-h1", "interleaved_1f1b"):
        with pytest.raises(ValueError, match="positive"):
            build_schedule(name, 2, 0, 0, 2 if name == "interleaved_1f1b" else 1)
    for name in ("zb-h1", "zb-h2"):
        with pytest.raises(ValueError, match=">= 0"):
            build_schedule(name, 2, 1, 4, 1, delay=-1)
    with pytest.raises(ValueError, match="more than one model chunk"):
        build_schedule("interleaved_zb", 2, 0, 4, 1)


def test_an_explicit_delay_of_zero_is_kept_on_every_rank():
    """``delay=0`` runs each W right after its B whatever the rank (it must not fall back to the rank's
    default, ``r``). (Planted: ``delay = delay or rank``.)"""
    assert build_schedule("zb-h1", 4, 2, 4, delay=0) == seq("F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3")
    assert build_schedule("zb-h2", 2, 1, 3, delay=0) == seq("F0 B0 W0 F1 B1 W1 F2 B2 W2")


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_interleaved_zero_bubble_at_m_equal_pp_idles_two_thirds_of_interleaved_1f1b(pp):
    """At m = pp every forward goes first; with equal op costs interleaved_zb then idles two thirds of
    interleaved 1F1B's (pp - 1) / (v m), as ``bubble_fraction`` says and ``timeline`` measures.
    (Planted: that branch of ``bubble_fraction`` returning a third.)"""
    for v in (2, 3):
        unit = {"F": 1 / v, "B": 2 / v, "B_input": 1 / v, "W": 1 / v}
        plans = [plan_for("interleaved_zb", pp, r, pp, v)[1] for r in range(pp)]
        measured = bubble_of(timeline(plans, unit))
        assert bubble_fraction(pp, pp, v, "interleaved_zb") == pytest.approx(measured)
        assert measured == pytest.approx((pp - 1) / (v * pp) * 2 / 3)


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_zb_h2_bubble_theory_matches_the_simulator(pp):
    """With m >= 2 pp and equal op costs ZB-H2 idles as much as ZB-H1, a third of 1F1B's (pp - 1) / m:
    ``bubble_fraction`` says so for "zb-h2" too. (Planted: the third applied to zb-h1 and
    interleaved_zb only, zb-h2 getting 1F1B's figure.)"""
    for m in (2 * pp, 3 * pp, 16):
        measured = bubble_of(timeline([plan_for("zb-h2", pp, r, m)[1] for r in range(pp)]))
        assert bubble_fraction(pp, m, schedule="zb-h2") == pytest.approx(measured) == pytest.approx((pp - 1) / (3 * m))


def test_default_schedule():
    """``auto``: interleaved 1F1B with virtual stages, 1F1B for a pipeline, accumulation without one.
    (Planted: interleaved_zb picked for v > 1.)"""
    assert default_schedule(2, 2) == "interleaved_1f1b"
    assert default_schedule(4, 1) == "1f1b"
    assert default_schedule(2, 1) == "1f1b"  # the smallest pipeline pipelines too (planted: pp > 2)
    assert default_schedule(1, 1) == "gradient_accumulation"


def test_config_names_a_schedule_that_cannot_run_its_chunk_count():
    """Config validation refuses a one-chunk schedule given virtual stages, and an interleaved one given
    none, before launch: passed, the first fails only when the executor builds its op list. (Planted:
    only more than two chunks refused, so the common v = 2 passed.)"""
    for name in ("gradient_accumulation", "1f1b", "zb-h1", "zb-h2"):
        assert schedule_problem(name, 1) is None
        for v in (2, 3):
            assert "runs one model chunk per rank" in schedule_problem(name, v), (name, v)
    for name in ("interleaved_1f1b", "interleaved_zb"):
        assert "needs more than one model chunk per rank" in schedule_problem(name, 1)
        assert schedule_problem(name, 2) is None and schedule_problem(name, 4) is None
    assert schedule_problem("auto", 1) is None and schedule_problem("auto", 3) is None


# --- plan.py ----------------------------------------------------------------------------------------

def test_simulator_catches_a_receive_that_is_never_sent():
    """Rank 1 waits for an activation rank 0 never sends (rank 0's plan is empty): a deadlock, not a
    receive that completes with no partner. (Planted: the never-sends check removed; the plan then
    "ran".)"""
    plans = [comm_plan([], 2, 0), comm_plan(seq("F0"), 2, 1)]
    with pytest.raises(PipelineDeadlock, match="rank 1 waits for act.* that rank 0 never sends"):
        simulate(plans)


@pytest.mark.parametrize("name,pp,m,v", [("1f1b", 3, 5, 1), ("zb-h2", 4, 8, 1), ("interleaved_1f1b", 3, 6, 2),
                                         ("interleaved_zb", 4, 8, 2), ("zb-v", 3, 6, 2)])
def test_no_op_starts_before_the_op_whose_output_it_takes_has_ended(name, pp, m, v):
    """Timed with unequal stages (a slow first rank), every op that takes a neighbour's activation or
    gradient starts after the op producing it ends. A middle rank's exchange sends to one neighbour and
    receives from the other in one batch, which completes only once both have posted theirs; the
    timeline must wait for both, or it times ops before their inputs exist and passes orders (zb-v's,
    ``v_orders_span``) whose plans would deadlock. (Planted: such a batch waiting for one partner.)"""
    placement = placement_of(name)
    plans = [plan_for(name, pp, r, m, v)[1] for r in range(pp)]
    costs = [{"F": 3.0 if r == 0 else 1.0, "B": 2.0 + r, "B_input": 1.0 + r, "W": 1.0} for r in range(pp)]
    times = timeline(plans, costs)
    ends = {(r, op): end for r, ops in enumerate(times) for op, _, end in ops}
    checked = 0
    for r, (plan, ops) in enumerate(zip(plans, times)):
        starts = {op: start for op, start, _ in ops}
        for step in plan:
            if step.needs is not None:
                holder, chunk = holder_of(pp, step.needs.stage, placement)
                made_by = Op("F" if step.needs.kind == "act" else "B", step.needs.microbatch, chunk)
                assert starts[step.op] >= ends[(holder, made_by)], (r, step.op, step.needs)
                checked += 1
    assert checked == 2 * m * (pp * v - 1 - (placement == "v"))  # every boundary but a V's turn, both ways


def test_bubble_is_the_idlest_ranks():
    """1F1B, pp 2, one micro-batch, rank 1 twice as slow: rank 0 works 3 of a 9-unit step (idle 6, a
    bubble of 2), rank 1 works 6 (0.5); ``bubble_of`` is the idlest rank's. (Planted: the least idle
    rank's: with equal op costs every rank is equally busy and no other test told them apart.)"""
    plans = [plan_for("1f1b", 2, r, 1)[1] for r in range(2)]
    times = timeline(plans, [{"F": 1.0, "B": 2.0}, {"F": 2.0, "B": 4.0}])
    assert [[(repr(op), a, b) for op, a, b in ops] for ops in times] == [
        [("F0", 0.0, 1.0), ("B0", 7.0, 9.0)], [("F0", 1.0, 3.0), ("B0", 3.0, 7.0)]]
    assert bubble_of(times) == pytest.approx(2.0)


# --- partition.py -----------------------------------------------------------------------------------

def test_every_chunk_keeps_a_block_under_a_heavy_head():
    """Two chunks a rank and a head worth 40 blocks: each rank first gets at least v blocks, so every
    chunk holds one and the split still sums to the layers. (Planted: ranks filled with at least one
    block, which gave [2, 1, 1, 1], five blocks of four.)"""
    assert balanced_split(4, 2, 2, head_cost=40.0) == [1, 1, 1, 1]
    assert balanced_split(6, 3, 2, head_cost=10.0) == [1] * 6
    for layers, pp, v, head in [(5, 2, 2, 3.0), (7, 3, 2, 30.0), (9, 2, 4, 100.0)]:
        split = balanced_split(layers, pp, v, head_cost=head)
        assert sum(split) == layers and min(split) >= 1, split


def test_interleaved_halves_taken_when_the_busiest_rank_is_no_busier():
    """12 blocks, pp 2, two chunks a rank, head 0.5: halves bring the busiest chunk from 3.5 to 3.43
    blocks of work while the busiest rank stays at 6.5; "without adding to the busiest rank's" allows
    equal. (Planted: the rank check made strict.)"""
    assert balanced_split(12, 2, 2, 0.5) == [3, 3, 3, 3]
    assert balanced_split(12, 2, 2, 0.5, 0.43) == [3, 3.5, 3, 2.5]


def test_half_block_split_prefers_whole_blocks_on_ties():
    """GPT 1.3B at pp 8 (docs/pipeline.md): stages filled from the last take the count nearest an even
    share, whole blocks on ties, so the first stage gets 3 blocks, not 3.5. (Planted: ties broken
    towards a half, which gave [3.5, 3, 3.5, ...].)"""
    assert balanced_split(24, 8, 1, 1.753, 0.4286) == [3, 3.5, 3.5, 3, 3, 3.5, 3, 1.5]


def test_an_infinite_head_cost_is_refused():
    """(Planted: only the lower bound checked, so an infinite head cost went through.)"""
    with pytest.raises(ValueError, match="head_cost"):
        balanced_split(24, 2, 1, float("inf"), 0.4)
    with pytest.raises(ValueError, match="head_cost"):
        balanced_split(24, 2, 1, float("inf"))


def test_a_chunk_outside_the_split_is_named():
    """Chunk 1 of a one-chunk-a-rank split is virtual stage pp: a ValueError naming it, not an
    IndexError from the bounds table. (Planted: ``stage < len(split)`` loosened to ``<=``.)"""
    with pytest.raises(ValueError, match="outside a 2-stage split"):
        stage_layers([2, 2], 2, 0, 1)
    with pytest.raises(ValueError, match="outside"):
        stage_layers([2, 2], 2, 1, 1)


def test_rank_work_sums_every_chunk_of_the_rank():
    """A rank's work is all its chunks' (virtual stages r, r + pp, ...), halves at their share.
    (Planted: only chunk 0 counted.)"""
    assert rank_work([2, 3, 4, 5], 2, 0, 0.4) == pytest.approx(6.0)
    assert rank_work([2, 3, 4, 5], 2, 1, 0.4) == pytest.approx(8.0)
    assert rank_work([1.5, 2.5, 2, 2], 2, 0, 0.4) == pytest.approx(2 * 0.4 + 0.6 + 2.0)


def test_live_peaks_keeps_only_points_no_other_matches_or_exceeds():
    """``live_peaks`` returns the fullest points only: no kept count vector is matched or exceeded in
    every chunk by another kept one (the planner stores these per schedule). (Planted: "exceeds" made
    strict in every chunk, which kept (2, 0) beside (2, 1); every peak stayed right, the list grew.)"""
    from parallel.pipeline.schedule import live_peaks

    for name, v in (("interleaved_1f1b", 2), ("interleaved_zb", 2), ("interleaved_1f1b", 3)):
        for pp, m in ((2, 4), (4, 8), (2, 3)):
            for rank in range(pp):
                front = live_peaks(build_schedule(name, pp, rank, m, v))
                for a in front:
                    for b in front:
                        assert a == b or not all(x >= y for x, y in zip(a, b)), (name, pp, m, rank, front)


def test_fullest_counts_cover_every_count_of_a_ramp_on_every_rank():
    """A ramp-up's steps run counts of micro-batches from 1 to the full batch's; on each rank the
    fullest points (``live_peaks``) of every count must be matched or exceeded, chunk by chunk, at one
    of the counts ``fullest_counts`` keeps, or a memory estimate built from those alone misses a step
    that holds more. Each schedule with its default delays, and the split-backward ones with the full
    count's delays tuned to unequal op costs as well, as the executor orders them (``costs_at``): at pp
    3 under ZB-H2 the costs pinned here move the middle rank's delay at 5 micro-batches, where it
    holds 5 against 4 at 6 or more, so tuned at every count the steps of 5 would be the fullest."""
    import random

    from parallel.pipeline.plan import StageCosts, schedule_for, weight_grad_delays
    from parallel.pipeline.ramp import fullest_counts
    from parallel.pipeline.schedule import live_peaks

    def covered(peaks, by):
        return all(any(all(a <= b for a, b in zip(counts, cover)) for cover in by) for counts in peaks)

    draw = random.Random(0)
    for name, pp, v in itertools.product(("1f1b", "interleaved_1f1b", "zb-h1", "zb-h2", "interleaved_zb", "zb-v"),
                                         range(2, 5), (1, 2)):
        if schedule_problem(name, v) is not None:
            continue
        unequal = StageCosts(tuple(tuple(draw.uniform(0.3, 2) for _ in range(3)) for _ in range(pp * v)),
                             tuple(draw.uniform(0.5, 2) for _ in range(pp * v)))
        pinned = [StageCosts(((1.3, 1.1, 1.3), (1.0, 1.3, 0.8), (0.6, 0.6, 1.3)), (1.5, 1.2, 0.6))] if (pp, v) == (3, 1) else []
        for costs, full in itertools.product([None, unequal, *pinned], range(1, 2 * pp + 3)):
            for rank in range(pp):
                for counts in (range(1, full + 1), range(pp, full + 1, pp)):  # a unit of 1, and of pp
                    if not counts:
                        continue
                    largest = max(counts)
                    peaks = {m: live_peaks(schedule_for(name, pp, rank, m, v, costs if m == largest else None))
                             for m in counts}
                    kept = fullest_counts(name, pp, v, counts)
                    cover = [vector for m in kept for vector in peaks[m]]
                    assert all(covered(peaks[m], cover) for m in counts), (name, pp, v, costs, counts, rank, kept)
    pinned = StageCosts(((1.3, 1.1, 1.3), (1.0, 1.3, 0.8), (0.6, 0.6, 1.3)), (1.5, 1.2, 0.6))
    assert weight_grad_delays("zb-h2", 3, 5, pinned) == (0, 2, 2)  # the case the executor's rule avoids
