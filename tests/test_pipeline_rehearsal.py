"""A pipeline's first-step rehearsal (``PipelineExecutor.rehearse``) leaves no trace.

On CUDA the engine runs each rank's ops of its first training step (and of its first evaluation) once
without any pipeline transfer, so that every kernel is loaded before a receive can be in flight (see
``rehearse``). Here, on gloo, rehearsal is switched on and each layout trains two steps and evaluates
once beside an engine that does not rehearse: losses, gradient norms, the evaluation and every
parameter must be bit for bit the same (dropout on, so the random state must be restored, and
gradients of the rehearsal must be dropped), the rehearsal must run this rank's forwards of the step,
and it must exchange nothing with a neighbour.
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
CASES = [("zb-h2", (1, 2, 2), 4, DROPOUT),
         ("zb-v", (1, 2, 2), 4, (*V2, *DROPOUT, "--zero.stage", "3")),
         ("1f1b", (2, 2, 1), 4, (*DROPOUT, "--parallel.sequence_parallel", "true", "--zero.stage", "2")),
         ("interleaved_1f1b", (1, 2, 2), 4, (*V2, *DROPOUT))]


def _train(cfg, topo, m: int, rehearses: bool) -> dict:
    torch.manual_seed(0)
    engine = Engine(cfg, topo, torch.device("cpu"))
    executor = engine.executor
    executor.rehearses = rehearses
    counts = {"exchanges": 0, "forwards": 0}
    exchange, forward_step = executor.link.exchange, executor.forward_step

    def counted_exchange(*args, **kwargs):
        counts["exchanges"] += 1
        return exchange(*args, **kwargs)

    def counted_forward(*args):
        counts["forwards"] += 1
        return forward_step(*args)

    executor.link.exchange, executor.forward_step = counted_exchange, counted_forward
    rehearsed = {}
    losses, norms = [], []
    for step in range(2):
        mine = _batches(step, m * topo.dp_size)[topo.dp_rank * m:(topo.dp_rank + 1) * m]
        due = executor.rehearsal_due()
        if due:  # what the rehearsal alone does: the engine's step rehearses, then runs
            before = dict(counts)
            engine._rehearse(mine, keep_graph=True)
            rehearsed["train"] = {k: counts[k] - before[k] for k in counts}
            executor._rehearsed.discard(True)
        out = engine.train_step(mine, lr=LR)
        losses.append(out.loss)
        norms.append(out.result.grad_norm)
    evaluated = engine.eval_loss(_batches(7, m * topo.dp_size)[topo.dp_rank * m:(topo.dp_rank + 1) * m])
    engine.data_parallel.wait_params()
    params = torch.cat([p.detach().reshape(-1) for chunk in engine.chunks for p in chunk.parameters()]).tolist()
    return {"losses": losses, "norms": [float(n) for n in norms], "eval": evaluated, "params": params, "rehearsed": rehearsed,
            "due_after": (executor.rehearsal_due(True), executor.rehearsal_due(False)), "pp_rank": topo.pp_rank}


def _world(rank, world_size):
    out = {}
    for schedule, layout, m, extra in CASES:
        topo = Topology(RankGrid(tp=layout[0], pp=layout[1], dp=layout[2]))
        cfg = _config(*layout, m, schedule, extra)
        out[schedule] = (_train(cfg, topo, m, rehearses=False), _train(cfg, topo, m, rehearses=True))
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


def test_rehearsal_runs_the_steps_forwards_and_exchanges_nothing(reports):
    """Planted: a rehearsal that skips ops; one that posts its sends."""
    for report in reports:
        for schedule, layout, m, extra in CASES:
            plain, rehearsed = report[schedule]
            assert plain["rehearsed"] == {} and plain["due_after"] == (False, False), schedule
            v = 2 if "--parallel.virtual_stages" in extra else 1
            ops, _ = plan_for(schedule, layout[1], rehearsed["pp_rank"], m, v)
            assert rehearsed["rehearsed"]["train"] == {"exchanges": 0,
                                                       "forwards": sum(op.kind == "F" for op in ops)}, schedule
            assert rehearsed["due_after"] == (False, False), schedule
