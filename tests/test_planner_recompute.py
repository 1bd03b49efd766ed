"""The planner's recomputed work per pipeline rank against the blocks the engine really checkpoints.

Each chunk checkpoints its every ``recompute_every``-th block from its first, so a rank with chunks
of n blocks recomputes ceil(n / k) of each; the time model once spread ``L / k`` blocks evenly over
the ranks, 3 where the engine recomputes 4 at GPT 6 x h, pp 2, k 2, and its step time and TFLOP/s
came out low by that block."""

import pytest

from megazero.config import load_config, resolve_config
from megazero.engine import build_chunks
from megazero.flops import flops_per_token
from megazero.planner import GPUS, Cluster, estimate_step
from megazero.planner.memory import rank_recomputed_work
from models.parallelize import RECOMPUTE_TARGETS
from parallel.tensor_parallel.apply import apply_activation_checkpointing


def _config(layers: int, pp: int, every: int, virtual: int = 1):
    """Whole blocks, evenly split: the engine's checkpointed modules are then blocks' worth of work."""
    split = [layers // (pp * virtual)] * (pp * virtual)
    return resolve_config(load_config(None, ["--parallel.pipeline_split", str(split),
        "--model.num_layers", str(layers), "--model.hidden_size", "64", "--model.num_heads", "4",
        "--model.vocab_size", "500", "--model.seq_length", "32", "--parallel.pp", str(pp),
        "--parallel.virtual_stages", str(virtual), "--parallel.recompute", "full", "--parallel.recompute_every",
        str(every), "--train.device", "cpu", "--train.micro_batch_size", "1", "--train.global_batch_size", "8"]),
        pp, pp)


@pytest.mark.parametrize("layers, pp, every, virtual", [(6, 2, 2, 1), (8, 2, 3, 1), (8, 2, 2, 2), (8, 4, 3, 1), (7, 1, 3, 1)])
def test_recomputed_work_is_the_blocks_the_engine_checkpoints(layers, pp, every, virtual):
    """(Planted: L / k blocks spread over the ranks by their share of the work.)"""
    cfg = _config(layers, pp, every, virtual)
    for rank in range(pp):
        checkpointed = sum(len(apply_activation_checkpointing(chunk, RECOMPUTE_TARGETS["full"], every))
                           for chunk in build_chunks(cfg, rank))
        assert rank_recomputed_work(cfg, rank) == pytest.approx(checkpointed), (rank, checkpointed)


def test_the_step_estimate_counts_the_recomputed_blocks():
    """GPT 6 x h at pp 2 with every second block recomputed: 4 blocks' forwards repeat, which the
    reported TFLOP/s (hardware FLOPs) holds over the MFU's model FLOPs."""
    cfg = _config(6, 2, 2)
    gpu = GPUS["h200"]
    est = estimate_step(cfg, Cluster(gpu, 2, 2))
    model = flops_per_token(cfg.model)
    block_forward = (model - 6 * cfg.model.hidden_size * cfg.model.vocab_size) / cfg.model.num_layers / 3
    hardware_over_model = est.tflops_per_gpu / (est.mfu * gpu.peak_tflops)
    assert hardware_over_model == pytest.approx((model + 4 * block_forward) / model, rel=1e-9)
