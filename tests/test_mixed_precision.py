"""bf16 and fp16 training through the engine on a real 2-rank gloo world.

The 16-bit runs keep 16-bit weights and an fp32 master; their losses over 4 steps stay within 2e-2
relative of the fp32 run (16-bit matmuls on CPU, 8-bit and 11-bit mantissas). fp16 runs under the
dynamic loss scaler, whose scale the step reports.
"""

import pytest
import torch

from megazero.config import load_config
from megazero.engine import Engine
from parallel.topology import RankGrid, Topology
from tests.distributed import run_world

STEPS = 4


def _batches(step):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 61, (2, 2, 17), generator=g)
    return [{"tokens": t[:, :-1], "labels": t[:, 1:]} for t in tokens]


def _run(topo, dtype, stage):
    cfg = load_config(None, ["--model.num_layers", "2", "--model.hidden_size", "32", "--model.num_heads", "4",
                             "--model.vocab_size", "61", "--model.seq_length", "16", "--precision.dtype", dtype,
                             "--zero.stage", str(stage), "--train.micro_batch_size", "2",
                             "--train.global_batch_size", "8", "--parallel.dp", "2", "--train.device", "cpu",
                             "--optimizer.lr", "1e-2"])
    engine = Engine(cfg, topo, torch.device("cpu"))
    losses, scales = [], []
    for step in range(STEPS):
        mine = _batches(step)[topo.dp_rank:topo.dp_rank + 1] * 2
        out = engine.train_step(mine)
        losses.append(out.loss)
        scales.append(out.result.loss_scale)
    dtypes = {p.dtype for chunk in engine.chunks for p in chunk.parameters()}
    return {"losses": losses, "scales": scales, "param_dtypes": dtypes, "master": engine.optimizer.master.dtype}


def _world(rank, world_size):
    topo = Topology(RankGrid(tp=1, pp=1, dp=2))
    return {(dtype, stage): _run(topo, dtype, stage)
            for dtype, stage in (("fp32", 1), ("bf16", 1), ("fp16", 2), ("fp16", 3))}


@pytest.fixture(scope="module")
def runs():
    return run_world(2, _world)[0]


@pytest.mark.parametrize("dtype, stage", [("bf16", 1), ("fp16", 2), ("fp16", 3)])
def test_sixteen_bit_training_tracks_fp32(runs, dtype, stage):
    run, ref = runs[(dtype, stage)], runs[("fp32", 1)]
    assert run["param_dtypes"] == {getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[dtype])}
    assert run["master"] == torch.float32
    for a, b in zip(run["losses"], ref["losses"]):
        assert abs(a - b) <= 2e-2 * abs(b), (run["losses"], ref["losses"])
    assert ref["losses"][-1] < ref["losses"][0]


def test_fp16_reports_the_dynamic_loss_scale(runs):
    assert runs[("fp16", 2)]["scales"] == [65536.0] * STEPS
    assert runs[("bf16", 1)]["scales"] == [1.0] * STEPS
