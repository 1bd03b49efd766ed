"""The engine in bf16 on two GPUs over NCCL tracks single-process fp32 AdamW.

The CPU suite runs every layout over gloo in fp32; what only a GPU exercises is NCCL itself (its
reduce-scatter and all-gather into bucket views, the batched point-to-point of the pipeline), the
CUDA fused AdamW with its device-side unscale and skip, and bf16 kernels. Each layout of two ranks,
(tp, pp, dp) = (1,1,2) under ZeRO 1, 2 and 3, (2,1,1) with sequence parallelism and (1,2,1), trains
3 steps in bf16 and is compared with the fp32 reference of ``tests/test_engine_equivalence.py`` on
the same global batches: the reported gradient norm every step within 2%, the losses within 2%,
and the whole update of the 16-bit weights within 20% relative error (bf16 rounds the weights
themselves, by up to 2^-9 of their size). Every rank is checked.

(Skipped unless two CUDA devices are visible.)
"""

from __future__ import annotations

import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megazero.engine import Engine
from models import GPT
from parallel.tensor_parallel.sharding import param_shards
from parallel.topology import RankGrid, Topology
from tests.test_engine_equivalence import MICROS_PER_RANK, STEPS, _batches, _config, _reference

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

CASES = [((1, 1, 2), 1, ()), ((1, 1, 2), 2, ()), ((1, 1, 2), 3, ()),
         ((2, 1, 1), 1, ("--parallel.sequence_parallel", "true")), ((1, 2, 1), 1, ())]


def _case(topo, layout, stage, extra) -> dict:
    tp, pp, dp = layout
    cfg = _config(tp, pp, dp, stage, ("--precision.dtype", "bf16", "--train.device", "cuda", *extra))
    engine = Engine(cfg, topo, torch.device("cuda", torch.cuda.current_device()))
    losses, norms = [], []
    for step in range(STEPS):
        batches = _batches(step, dp)
        out = engine.train_step(batches[topo.dp_rank * MICROS_PER_RANK:(topo.dp_rank + 1) * MICROS_PER_RANK])
        losses.append(out.loss)
        norms.append(out.result.grad_norm)
    engine.data_parallel.wait_params()
    initial = dict(GPT(cfg.model, vocab_multiple=128 * tp, seed=cfg.train.seed).named_parameters())
    reference, ref_losses, ref_norms = _reference(cfg, dp)
    trained = dict(reference.named_parameters())
    diff_sq = update_sq = 0.0
    for chunk in engine.chunks:
        shards = param_shards(chunk)
        for name, p in chunk.named_parameters():
            key = "embedding.tokens.weight" if name == "lm_head.weight" and name not in trained else name
            after, before = trained[key].detach(), initial[key].detach()
            if name in shards:
                after, before = shards[name].take(after), shards[name].take(before)
            diff_sq += (p.detach().float().cpu() - after).pow(2).sum().item()
            update_sq += (after - before).pow(2).sum().item()
    return {"norm_err": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
            "loss_err": max(abs(a - b) / b for a, b in zip(losses, ref_losses)),
            "update_err": (diff_sq / update_sq) ** 0.5}


def _child(rank: int, world_size: int, init_file: str, results) -> None:
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                device_id=torch.device("cuda", rank))
        report = {}
        for layout, stage, extra in CASES:
            topo = Topology(RankGrid(tp=layout[0], pp=layout[1], dp=layout[2]))
            report[(layout, stage, extra)] = _case(topo, layout, stage, extra)
        results.put((rank, "ok", report))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(prefix="megazero-nccl-"), "store")
    procs = [ctx.Process(target=_child, args=(r, 2, init_file, results)) for r in range(2)]
    for p in procs:
        p.start()
    outcome = dict((rank, (status, value)) for rank, status, value in (results.get(timeout=600) for _ in procs))
    for p in procs:
        p.join(timeout=30)
    errors = [value for status, value in outcome.values() if status == "error"]
    assert not errors, errors[0]
    return [outcome[r][1] for r in range(2)]


@pytest.mark.parametrize("layout, stage, extra", CASES)
def test_bf16_on_nccl_tracks_fp32_reference(reports, layout, stage, extra):
    for rank, report in enumerate(reports):
        value = report[(layout, stage, extra)]
        assert value["norm_err"] < 0.02, (rank, value)
        assert value["loss_err"] < 0.02, (rank, value)
        assert value["update_err"] < 0.2, (rank, value)
