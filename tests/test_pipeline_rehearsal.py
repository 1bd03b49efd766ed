"""A pipeline's first-step rehearsal (``PipelineExecutor.rehearse``) leaves no trace.

On CUDA the engine runs each rank's ops of its first training step (and of its first evaluation) once
without any pipeline transfer, so that every kernel is loaded before a receive can be in flight (see
``rehearse``). Here, on gloo, rehearsal is switched on and each layout trains two steps and evaluates
once beside an engine that does not rehearse: losses, gradient norms, the evaluation and every
parameter must be bit for bit the same (dropout on, so the random state must be restored, and
gradients of the rehearsal must be dropped), the rehearsal must run this rank's forwards of the step,
and it must exchange nothing with a neighbour. A batch that ramps up from one micro-batch is rehearsed
again at its first step of several; and a rehearsal holds no more unsent messages than the step does.
Each rehearsal's forwards and backwards are handed what the step's are (inputs alike, grad mode, which
backward is the last), in its order; and on the CPU an engine does not rehearse unless told to.
"""

from __future__ import annotations

import pytest
import torch

from megazero.engine import Engine
from parallel.pipeline.plan import plan_for
from parallel.topology import RankGrid, Topology
from tests.distributed import run_world
from tests.test_pipeline_zero_bubble import LR, _batches, _config

V2 = ("--parallel.virtual_stages", "2")
DROPOUT = ("--model.dropout", "0.1")
CASES = [("zb-h2", (1, 2, 2), (4, 4), DROPOUT),
         ("zb-v", (1, 2, 2), (4, 4), (*V2, *DROPOUT, "--zero.stage", "3")),
         ("1f1b", (2, 2, 1), (4, 4), (*DROPOUT, "--parallel.sequence_parallel", "true", "--zero.stage", "2")),
         ("interleaved_1f1b", (1, 2, 2), (4, 4), (*V2, *DROPOUT)),
         ("zb-h1", (1, 2, 2), (1, 1, 4, 2), DROPOUT)]
"""(schedule, (tp, pp, dp), micro-batches of each step, overrides). The last ramps its batch up from one
micro-batch: the step of four sums micro-batches, which the rehearsal of one never did (and the second
step of one has nothing left to rehearse)."""


def _train(cfg, topo, steps: tuple[int, ...], rehearses: bool) -> dict:
    torch.manual_seed(0)
    engine = Engine(cfg, topo, torch.device("cpu"))
    executor = engine.executor
    default = executor.rehearses
    executor.rehearses = rehearses
    counts = {"exchanges": 0, "forwards": 0}
    exchange, forward_step, rehearse = executor.link.exchange, executor.forward_step, executor.rehearse
    before_backward = executor.before_backward
    trace = []  # what every forward and backward was handed, rehearsing or not, in order

    def counted_exchange(*args, **kwargs):
        counts["exchanges"] += 1
        return exchange(*args, **kwargs)

    def counted_forward(chunk, x, microbatch, first, last):
        counts["forwards"] += 1
        trace.append(("F", engine.chunks.index(chunk), id(microbatch), first, last, torch.is_grad_enabled(),
                      None if x is None else (tuple(x.shape), x.dtype, x.requires_grad)))
        return forward_step(chunk, x, microbatch, first, last)

    def traced_backward(op, last):
        trace.append(("B", op, last))
        before_backward(op, last)

    rehearsals = []  # (micro-batches, training, exchanges and forwards in it) of each rehearsal
    rehearsed_spans = []  # where each rehearsal's ops lie in ``trace``

    def counted_rehearse(microbatches, keep_graph=True):
        before, start = dict(counts), len(trace)
        rehearse(microbatches, keep_graph)
        rehearsals.append((len(microbatches), keep_graph, {k: counts[k] - before[k] for k in counts}))
        rehearsed_spans.append((start, len(trace)))

    executor.link.exchange, executor.forward_step, executor.rehearse = counted_exchange, counted_forward, counted_rehearse
    executor.before_backward = traced_backward
    losses, norms = [], []
    for step, m in enumerate(steps):
        mine = _batches(step, m * topo.dp_size)[topo.dp_rank * m:(topo.dp_rank + 1) * m]
        out = engine.train_step(mine, lr=LR)
        losses.append(out.loss)
        norms.append(float(out.result.grad_norm))
    m = steps[-1]
    evaluated = engine.eval_loss(_batches(7, m * topo.dp_size)[topo.dp_rank * m:(topo.dp_rank + 1) * m])
    engine.data_parallel.wait_params()
    params = torch.cat([p.detach().reshape(-1) for chunk in engine.chunks for p in chunk.parameters()]).tolist()
    # each rehearsal beside the step that followed it (the engine runs that step right after)
    rehearsed_and_run = [(trace[start:end], trace[end:2 * end - start]) for start, end in rehearsed_spans]
    return {"losses": losses, "norms": norms, "eval": evaluated, "params": params, "rehearsals": rehearsals,
            "due_after": [executor.rehearsal_due(m, keep_graph) for m in (1, 4) for keep_graph in (True, False)],
            "pp_rank": topo.pp_rank, "default": default, "rehearsed_and_run": rehearsed_and_run}


def _held_sends(rank, world_size):
    """The most messages rank ``rank`` held for sending after any op, rehearsing and in the step."""
    import parallel.pipeline.executor as pipeline_executor

    m = 8
    engine = Engine(_config(1, 2, 1, m, "interleaved_1f1b", V2), Topology(RankGrid(tp=1, pp=2, dp=1)),
                    torch.device("cpu"))
    engine.executor.rehearses = True
    most, phase = {"rehearsal": 0, "step": 0}, ["step"]
    for name in ("forward", "backward"):
        run_op = getattr(pipeline_executor._StepRun, name)

        def counted(self, op, received, run_op=run_op):
            run_op(self, op, received)
            most[phase[0]] = max(most[phase[0]], len(self.outbox))
        setattr(pipeline_executor._StepRun, name, counted)
    rehearse = engine.executor.rehearse

    def rehearsing(*args, **kwargs):
        phase[0] = "rehearsal"
        try:
            rehearse(*args, **kwargs)
        finally:
            phase[0] = "step"
    engine.executor.rehearse = rehearsing
    engine.train_step(_batches(0, m), lr=LR)
    return most


def _world(rank, world_size):
    out = {}
    for schedule, layout, steps, extra in CASES:
        topo = Topology(RankGrid(tp=layout[0], pp=layout[1], dp=layout[2]))
        cfg = _config(*layout, max(steps), schedule, extra)
        out[schedule] = (_train(cfg, topo, steps, rehearses=False), _train(cfg, topo, steps, rehearses=True))
    return out


@pytest.fixture(scope="module")
def reports():
    return run_world(4, _world, timeout=600)


def test_rehearsed_training_is_bit_for_bit_the_same(reports):
    """Planted: the engine not zeroing the rehearsal's gradients (the first loss agrees, the first
    gradient norm does not); the random state not restored (dropout then masks other units)."""
    for report in reports:
        for schedule, (plain, rehearsed) in report.items():
            assert rehearsed["losses"] == plain["losses"], schedule
            assert rehearsed["norms"] == plain["norms"], schedule
            assert rehearsed["eval"] == plain["eval"], schedule
            assert rehearsed["params"] == plain["params"], schedule


def test_rehearsals_run_the_steps_forwards_exchange_nothing_and_come_when_due(reports):
    """A rehearsal before the first training step and the first evaluation, and again before the first
    step over several micro-batches after one of a single micro-batch. Planted: a rehearsal that skips
    ops; one that posts its sends; no second rehearsal when the batch ramps up; a second step of one
    micro-batch rehearsed again (``micro_batches >= 1``)."""
    for report in reports:
        for schedule, layout, steps, extra in CASES:
            plain, rehearsed = report[schedule]
            assert plain["rehearsals"] == [] and plain["due_after"] == [False] * 4, schedule
            v = 2 if "--parallel.virtual_stages" in extra else 1
            training = [steps[0]] + ([m for m in steps[1:] if m > 1][:1] if steps[0] == 1 else [])
            expected = [(m, True, {"exchanges": 0, "forwards": sum(
                op.kind == "F" for op in plan_for(schedule, layout[1], rehearsed["pp_rank"], m, v)[0])})
                for m in training]
            assert rehearsed["rehearsals"][:-1] == expected, schedule
            assert rehearsed["rehearsals"][-1][:2] == (steps[-1], False), schedule  # the evaluation's
            assert rehearsed["due_after"] == [False] * 4, schedule


def test_rehearsal_holds_no_more_sends_than_the_step():
    """The real step frees each send once it completes; a rehearsal that kept every dropped send until
    its end would hold all of the step's messages at once (planted: 24 activations on rank 0, where
    the step holds 2), memory the step itself never needs."""
    for most in run_world(2, _held_sends):
        assert most["rehearsal"] <= most["step"], most


def test_a_rehearsal_hands_its_ops_what_the_step_does(reports):
    """Each forward of a rehearsal gets what the step's gets (its chunk and micro-batch, an input of the
    same shape and dtype, grad mode, whether the input needs a gradient) and each backward is announced
    to the reducer as in the step (which is the last: stages 0 and 1 reduce during it), in the step's
    order: other arguments run other kernels than the step will. Planted: the evaluation's rehearsal
    with gradients on, or keeping its graph (its inputs needing gradients); the rehearsal's backwards
    never told which is the last (no ``backward_total``); its plan made without the op costs."""
    for report in reports:
        for schedule, (plain, rehearsed) in report.items():
            assert rehearsed["rehearsed_and_run"], schedule
            for rehearsal, step in rehearsed["rehearsed_and_run"]:
                assert rehearsal == step, schedule


def test_a_cpu_engine_does_not_rehearse_unless_told(reports):
    """Rehearsal is for CUDA's kernel loading: on the CPU it would only run every first step twice
    (planted: ``rehearses`` on whenever pp > 1)."""
    for report in reports:
        for schedule, (plain, rehearsed) in report.items():
            assert plain["default"] is False and rehearsed["default"] is False, schedule
