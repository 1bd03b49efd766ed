"""1F1B and interleaved pipelines on real gloo ranks equal single-process gradient accumulation.

The stand-in model is a small decoder skeleton: a tied token embedding and LM head with a cross-
entropy loss around residual MLP blocks that are tensor-parallel (column- then row-parallel, with
sequence parallelism optionally), so every traffic pattern of the real model crosses the pipeline:
tied-embedding gradients over the embedding group, tensor-parallel collectives inside stages,
sequence-sharded activations between stages, data-parallel averaging after the step.

One 8-rank world runs every case (tp x pp x dp layouts that fill 8 ranks); each rank compares its
own parameter shards with a reference it computes itself in one process, and returns the errors.
A second world runs the wider matrix under ``-m slow``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel.pipeline import (PipelineExecutor, PipelineTimeout, allreduce_data_parallel_grads,
                               sum_tied_grads)
from parallel.pipeline.partition import resolve_split, stage_layers
from parallel.pipeline.schedule import max_live_activations
from parallel.tensor_parallel.collectives import (copy_to_tp, gather_from_tp, gather_sequence, reduce_from_tp,
                                                  reduce_scatter_sequence, split_sequence)
from parallel.topology import RankGrid, Topology
from tests.distributed import run_world

VOCAB, HIDDEN, FFN, SEQ, MICRO = 16, 8, 16, 4, 2
TOL = 2e-5  # fp32: gradients summed in a different order than the reference, relative to max |grad|


def _gather_seq_replicated(x, group):
    """Gather the tokens for a computation every rank repeats in full; backward keeps this rank's part.

    That is ``gather_from_tp``'s contract (whatever follows is replicated across tp), applied to the
    sequence-parallel token chunks (``[batch * seq]`` in memory order) by moving tokens to the last dim.
    """
    batch, hidden = x.shape[0], x.shape[-1]
    return gather_from_tp(x.reshape(-1, hidden).t(), group).t().reshape(batch, -1, hidden)


# --- the stand-in model -------------------------------------------------------------------------------

def full_params(num_layers: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = {"emb": torch.randn(VOCAB, HIDDEN, generator=g) * 0.5}
    for i in range(num_layers):
        p[f"w1.{i}"] = torch.randn(FFN, HIDDEN, generator=g) * 0.3
        p[f"b1.{i}"] = torch.randn(FFN, generator=g) * 0.1
        p[f"w2.{i}"] = torch.randn(HIDDEN, FFN, generator=g) * 0.3
        p[f"b2.{i}"] = torch.randn(HIDDEN, generator=g) * 0.1
    return p


class Block(nn.Module):
    def __init__(self, full, i, tp_rank=0, tp=1, group=None, sp=False):
        super().__init__()
        cols = slice(tp_rank * FFN // tp, (tp_rank + 1) * FFN // tp)
        # group None: a single rank and no collectives (to the collectives None means the whole world)
        self.index, self.group, self.sp, self.cols = i, group if tp > 1 else None, sp, cols
        self.w1 = nn.Parameter(full[f"w1.{i}"][cols].clone())
        self.b1 = nn.Parameter(full[f"b1.{i}"][cols].clone())
        self.w2 = nn.Parameter(full[f"w2.{i}"][:, cols].clone())
        self.b2 = nn.Parameter(full[f"b2.{i}"].clone())

    def forward(self, x):
        h = x
        if self.group is not None:
            h = gather_sequence(x, self.group) if self.sp else copy_to_tp(x, self.group)
        h = F.linear(F.gelu(F.linear(h, self.w1, self.b1)), self.w2)
        if self.group is not None:
            h = reduce_scatter_sequence(h, self.group) if self.sp else reduce_from_tp(h, self.group)
        return x + h + self.b2

    def reference_slices(self):
        i, c = self.index, self.cols
        return {"w1": (f"w1.{i}", (c,)), "b1": (f"b1.{i}", (c,)), "w2": (f"w2.{i}", (slice(None), c)),
                "b2": (f"b2.{i}", ())}


class Stage(nn.Module):
    """Blocks ``layers``, the embedding when first, the (tied) head and loss when last."""

    def __init__(self, full, layers, first, last, tp_rank=0, tp=1, group=None, sp=False):
        super().__init__()
        self.first, self.last, self.sp = first, last, sp and tp > 1
        self.group = group if tp > 1 else None
        self.emb = nn.Parameter(full["emb"].clone()) if first else None
        self.head = self.emb if first and last else (nn.Parameter(full["emb"].clone()) if last else None)
        self.blocks = nn.ModuleList(Block(full, i, tp_rank, tp, group, sp) for i in layers)

    def forward(self, x, targets=None):
        if self.first:
            x = F.embedding(x, self.emb)
            if self.sp:
                x = split_sequence(x, self.group)
        for block in self.blocks:
            x = block(x)
        if not self.last:
            return x
        if self.sp:
            x = _gather_seq_replicated(x, self.group)
        return F.cross_entropy((x @ self.head.t()).flatten(0, 1), targets.flatten())


def batches(count: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (MICRO, SEQ), generator=g), torch.randint(0, VOCAB, (MICRO, SEQ), generator=g))
            for _ in range(count)]


def reference(num_layers: int, data):
    """One process, all layers, gradient of the mean loss over every micro-batch."""
    model = Stage(full_params(num_layers), range(num_layers), True, True)
    losses = [model(x, y) for x, y in data]
    loss = torch.stack(losses).mean()
    loss.backward()
    return model, loss.item()


def _grad_error(chunks, ref: Stage) -> float:
    worst, scale = 0.0, 1e-12
    ref_blocks = {b.index: b for b in ref.blocks}
    for chunk in chunks:
        for which in (chunk.emb, chunk.head if chunk.head is not chunk.emb else None):
            if which is not None:
                worst = max(worst, (which.grad - ref.emb.grad).abs().max().item())
        for block in chunk.blocks:
            rb = ref_blocks[block.index]
            for name, (_, index) in block.reference_slices().items():
                expect = getattr(rb, name).grad[index] if index else getattr(rb, name).grad
                worst = max(worst, (getattr(block, name).grad - expect).abs().max().item())
    for p in ref.parameters():
        scale = max(scale, p.grad.abs().max().item())
    return worst / scale


# --- the distributed cases ----------------------------------------------------------------------------

LAYOUTS = [(1, 2, 4), (1, 4, 2), (2, 2, 2), (2, 4, 1)]  # (tp, pp, dp) filling 8 ranks


def cases_for(tp: int, pp: int) -> list[tuple[str, int, int, bool]]:
    """(schedule, micro-batches, virtual stages, sequence parallel): m in {pp, 2pp, odd} per schedule."""
    odd = pp + 1 if pp % 2 == 0 else pp + 2
    cases = [("1f1b", m, 1, False) for m in (pp, 2 * pp, odd)]
    cases += [("interleaved_1f1b", m, 2, False) for m in (pp, 2 * pp, odd)]
    cases += [("gradient_accumulation", 3, 1, False)]
    if tp > 1:
        cases += [("1f1b", odd, 1, True), ("interleaved_1f1b", 2 * pp, 2, True)]
    return cases


def _run_case(rank, tp, pp, dp, topo, schedule, m, v, sp):
    num_layers = 2 * pp * v - 1  # uneven on purpose: the split is not a trivial one
    split = resolve_split(num_layers, pp, v)
    full = full_params(num_layers)
    c = topo.coord
    chunks = []
    for chunk in range(v):
        stage = chunk * pp + c.pp
        chunks.append(Stage(full, stage_layers(split, pp, c.pp, chunk), stage == 0, stage == pp * v - 1,
                            c.tp, tp, topo.tp_group, sp))
    shape = (MICRO, SEQ // tp if sp and tp > 1 else SEQ, HIDDEN)
    hook_calls = []
    executor = PipelineExecutor(chunks, topo, shape, schedule=schedule, timeout_s=60,
                                before_backward=lambda op, last: hook_calls.append((op, last)))
    data = batches(dp * m)
    eval_loss = executor.forward_only(data[c.dp * m:(c.dp + 1) * m])
    eval_live, eval_grads = executor.stats.peak_live, [p.grad for ch in chunks for p in ch.parameters()]
    loss = executor.step(data[c.dp * m:(c.dp + 1) * m])
    params = [p for ch in chunks for p in ch.parameters()]
    sum_tied_grads([p.grad for ch in chunks for p in (ch.emb, ch.head) if p is not None and p.grad is not None],
                   topo.embedding_group)
    if sp and tp > 1:  # a bias added to sequence shards collects only its shard's gradient
        for b in (blk.b2 for ch in chunks for blk in ch.blocks):
            dist.all_reduce(b.grad, group=topo.tp_group)
    allreduce_data_parallel_grads(params, topo)
    ref, ref_loss = reference(num_layers, data)
    return {"loss": loss.item(), "ref_loss": ref_loss, "grad_error": _grad_error(chunks, ref),
            "peak_live": executor.stats.peak_live, "schedule_live": max_live_activations(executor.stats.ops),
            "pp_rank": c.pp, "sent": executor.stats.sent, "released": executor.stats.released,
            "hook_ok": [op for op, _ in hook_calls] == [op for op in executor.stats.ops if op.kind == "B"]
            and [last for _, last in hook_calls] == [False] * (len(hook_calls) - 1) + [True],
            "eval_loss": eval_loss.item(), "eval_live": eval_live, "eval_grads": sum(g is not None for g in eval_grads)}


def slow_cases_for(tp: int, pp: int) -> list[tuple[str, int, int, bool]]:
    """The wider matrix: fewer micro-batches than stages, long runs, three and four virtual stages."""
    cases = [("1f1b", m, 1, False) for m in dict.fromkeys((1, pp - 1, 4 * pp + 1))]
    cases += [("interleaved_1f1b", m, v, False) for v in (3, 4) for m in (pp, 3 * pp)]
    if tp > 1:
        cases += [("interleaved_1f1b", 3 * pp, 3, True), ("gradient_accumulation", 5, 1, True)]
    return cases


def _world8(rank, world_size, slow=False):
    torch.manual_seed(0)
    out = {}
    for tp, pp, dp in LAYOUTS:
        topo = Topology(RankGrid(tp=tp, pp=pp, dp=dp))
        for schedule, m, v, sp in (slow_cases_for if slow else cases_for)(tp, pp):
            out[(tp, pp, dp, schedule, m, v, sp)] = _run_case(rank, tp, pp, dp, topo, schedule, m, v, sp)
    return out


def _hang(rank, world_size):
    """Stage 1 expects one micro-batch more than stage 0 sends: it must time out and say on what."""
    topo = Topology(RankGrid(tp=1, pp=2, dp=1))
    stage = Stage(full_params(2), [rank], rank == 0, rank == 1)
    executor = PipelineExecutor([stage], topo, (MICRO, SEQ, HIDDEN), timeout_s=3)
    try:
        executor.step(batches(2 + rank))
    except PipelineTimeout as err:
        return str(err)
    except RuntimeError as err:  # the other rank: its peer went away
        return "peer: " + str(err)[:200]
    # Stage 0 finished its part: stay connected past stage 1's 3 s timeout, or closing the gloo pairs
    # would fail stage 1's receive with "connection closed" before its own timeout could speak.
    time.sleep(6)
    return "finished"


def _profiled(rank, world_size):
    """One profiled 1F1B step of two stages: each op's time, anchored to the wall clock."""
    topo = Topology(RankGrid(tp=1, pp=2, dp=1))
    stage = Stage(full_params(2), [rank], rank == 0, rank == 1)
    executor = PipelineExecutor([stage], topo, (MICRO, SEQ, HIDDEN), timeout_s=30, profile=True)
    executor.step(batches(3))
    stats = executor.stats
    return {"ops": [(op.kind, op.microbatch) for op in stats.ops], "first_op_at": stats.first_op_at,
            "op_times": stats.op_times}


@pytest.fixture(scope="module")
def world8():
    return run_world(8, _world8, timeout=240)


@pytest.fixture(scope="module")
def world8_slow():
    return run_world(8, _world8, True, timeout=600)


ALL_CASES = [(tp, pp, dp) + case for tp, pp, dp in LAYOUTS for case in cases_for(tp, pp)]
SLOW_CASES = [(tp, pp, dp) + case for tp, pp, dp in LAYOUTS for case in slow_cases_for(tp, pp)]


def _ids(case):
    tp, pp, dp, schedule, m, v, sp = case
    return f"tp{tp}-pp{pp}-dp{dp}-{schedule}-m{m}-v{v}" + ("-sp" if sp else "")


@pytest.mark.parametrize("case", ALL_CASES, ids=_ids)
def test_loss_equals_single_process_on_every_rank(world8, case):
    for rank, result in enumerate(world8):
        r = result[case]
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5), f"rank {rank}"


@pytest.mark.parametrize("case", ALL_CASES, ids=_ids)
def test_forward_only_loss_equals_single_process_and_keeps_nothing(world8, case):
    for rank, result in enumerate(world8):
        r = result[case]
        assert r["eval_loss"] == pytest.approx(r["ref_loss"], rel=1e-5), f"rank {rank}"
        assert r["eval_live"] == 0 and r["eval_grads"] == 0


@pytest.mark.parametrize("case", ALL_CASES, ids=_ids)
def test_gradients_equal_single_process(world8, case):
    for rank, result in enumerate(world8):
        error = result[case]["grad_error"]
        assert error <= TOL, f"rank {rank}: relative gradient error {error:.2e}"


@pytest.mark.parametrize("case", ALL_CASES, ids=_ids)
def test_measured_live_activations_match_schedule(world8, case):
    """Measured on the executor; for 1F1B also at most pp - r on stage r."""
    pp = case[1]
    for result in world8:
        r = result[case]
        assert r["peak_live"] == r["schedule_live"]
        if case[3] == "1f1b":
            assert r["peak_live"] <= pp - r["pp_rank"]


@pytest.mark.parametrize("case", ALL_CASES, ids=_ids)
def test_before_backward_hook_sees_every_backward_and_flags_the_last(world8, case):
    assert all(result[case]["hook_ok"] for result in world8)


@pytest.mark.parametrize("case", ALL_CASES, ids=_ids)
def test_every_send_buffer_released(world8, case):
    tp, pp, dp, schedule, m, v, sp = case
    for result in world8:
        r = result[case]
        # every micro-batch crosses each of the pp*v - 1 boundaries once forward and once backward
        assert r["released"] == r["sent"] > 0
    assert sum(result[case]["sent"] for result in world8) == tp * dp * 2 * m * (pp * v - 1)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=_ids)
def test_wider_matrix_equals_single_process(world8_slow, case):
    pp = case[1]
    for rank, result in enumerate(world8_slow):
        r = result[case]
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5), f"rank {rank}"
        assert r["grad_error"] <= TOL, f"rank {rank}: relative gradient error {r['grad_error']:.2e}"
        assert r["peak_live"] == r["schedule_live"] and r["released"] == r["sent"]
        if case[3] == "1f1b":
            assert r["peak_live"] <= pp - r["pp_rank"]


def test_profiled_timelines_of_two_stages_share_a_clock():
    """The second stage's first forward waits for the first stage's: on the shared clock it starts
    after that one ends, and every rank's ops run in order without overlapping."""
    first, second = run_world(2, _profiled, timeout=60)
    assert first["ops"][0] == second["ops"][0] == ("F", 0)
    for rank in (first, second):
        assert rank["first_op_at"] > 0 and rank["op_times"][0][0] == 0.0
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(rank["op_times"], rank["op_times"][1:]))
    first_f0_end = first["first_op_at"] + first["op_times"][0][1]
    assert second["first_op_at"] >= first_f0_end - 5e-4


def test_a_last_stage_returning_per_token_losses_is_refused_by_name(one_rank_group):
    """The loss is summed over micro-batches as a scalar: a ``forward_step`` that hands back its
    per-token losses (no mean) stops with the shape it returned, not a reshape error inside the executor."""
    topo = Topology(RankGrid(tp=1, pp=1, dp=1))
    executor = PipelineExecutor([Stage(full_params(1), [0], True, True)], topo, (MICRO, SEQ, HIDDEN),
                                forward_step=lambda module, x, mb, first, last: module(*mb) * torch.ones(MICRO, SEQ))
    with pytest.raises(ValueError, match=r"must return a scalar loss, got shape \(2, 4\)"):
        executor.step(batches(2))


def test_a_stage_that_ignores_its_input_is_refused_by_name():
    """A stage whose output does not depend on the activation it received would send its predecessor
    no gradient: the backward says which virtual stage, instead of failing on a missing ``.grad``. Two
    chunks of one rank hand over in memory, so no process group is needed."""
    from types import SimpleNamespace

    from parallel.pipeline.executor import _StepRun, default_forward_step
    from parallel.pipeline.schedule import Op

    class Ignoring(Stage):
        def forward(self, x, targets=None):
            return super().forward(torch.zeros_like(x), targets)

    full = full_params(2)
    chunks = [Stage(full, [0], True, False), Ignoring(full, [1], False, True)]
    executor = SimpleNamespace(pp=1, rank=0, v=2, placement="loop", chunks=chunks, forward_step=default_forward_step,
                               before_backward=None, wgrad=None, stats=SimpleNamespace(peak_live=0))
    run = _StepRun(executor, batches(1), 1.0, True, [Op("B", 0, 1)])
    run.op(Op("F", 0, 0), None)
    run.op(Op("F", 0, 1), None)
    with pytest.raises(ValueError, match="virtual stage 1 did not use its input"):
        run.op(Op("B", 0, 1), None)


def test_hang_fails_fast_and_names_what_it_waited_on():
    """Also the example docs/pipeline.md quotes, which is this very hang: the message begins with it."""
    results = run_world(2, _hang, timeout=60)
    assert "pipeline rank 1" in results[1] and "recv act(mb2 from stage 0) from pipeline rank 0" in results[1]
    page = (Path(__file__).resolve().parent.parent / "docs" / "pipeline.md").read_text(encoding="utf-8")
    quoted = re.search(r"e\.g\. `(rank \d+ \(pipeline rank \d+\) gave up after [^`]+)`", " ".join(page.split()))
    assert quoted and results[1].startswith(quoted.group(1)), (quoted, results[1])
