"""The planner's recomputed work per pipeline rank against the blocks the engine really checkpoints.

Each chunk checkpoints its every ``recompute_every``-th block from its first, so a rank with chunks
of n blocks recomputes ceil(n / k) of each; the time model once spread ``L / k`` blocks evenly over
the ranks, 3 where the engine recomputes 4 at GPT 6 x h, pp 2, k 2, and its step time and TFLOP/s
came out low by that block. The planner's refusal of a recompute that replays the tensor-parallel
random stream is the engine's verdict on the same checkpointed blocks."""

import dataclasses

import pytest

from megazero.config import load_config, resolve_config
from megazero.engine import build_chunks, pipeline_costs
from megazero.flops import attention_share, flops_per_token
from megazero.planner import GPUS, Cluster, estimate_step
from megazero.planner.memory import rank_recomputed_work
from models.parallelize import RECOMPUTE_TARGETS
from parallel.tensor_parallel.apply import apply_activation_checkpointing


def _config(layers: int, pp: int, every: int, virtual: int = 1, split=None):
    """Whole blocks, evenly split unless ``split`` says otherwise: the engine's checkpointed modules
    are then blocks' worth of work."""
    split = split or [layers // (pp * virtual)] * (pp * virtual)
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


def _recomputed_by_stage(cfg) -> list[float]:
    """What each stage's input-gradient op costs beyond the same layout without recompute, in blocks'
    forwards: the forward work the zero-bubble schedules expect its backward to repeat."""
    plain = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, recompute="none"))
    with_recompute, without = pipeline_costs(cfg), pipeline_costs(plain)
    return [a[1] - b[1] for a, b in zip(with_recompute.ops, without.ops)]


@pytest.mark.parametrize("layers, pp, every", [(6, 2, 2), (8, 2, 3), (8, 4, 3)])
def test_zero_bubble_op_costs_count_the_blocks_the_engine_checkpoints(layers, pp, every):
    """The op costs that time the zero-bubble schedules' weight gradients repeat what the engine
    checkpoints: ceil(n / k) blocks of a stage of n (planted: n / k, a third of a block short at 8
    blocks a rank and k 3)."""
    cfg = _config(layers, pp, every)
    for rank, again in enumerate(_recomputed_by_stage(cfg)):
        (chunk,) = build_chunks(cfg, rank)
        checkpointed = len(apply_activation_checkpointing(chunk, RECOMPUTE_TARGETS["full"], every))
        assert again == pytest.approx(checkpointed), (rank, checkpointed)


def test_a_half_block_repeats_its_half():
    """Split [3.5, 3.5], every second block: the first stage checkpoints blocks 0 and 2, the second
    block 3's MLP half and block 5, both in the op costs and in the planner's count."""
    cfg = _config(7, 2, 2, split=[3.5, 3.5])
    share = attention_share(cfg.model)
    expected = [2.0, (1.0 - share) + 1.0]
    assert _recomputed_by_stage(cfg) == pytest.approx(expected)
    assert [rank_recomputed_work(cfg, rank) for rank in range(2)] == pytest.approx(expected)


def test_selective_recompute_repeats_each_blocks_attention_core():
    """Selective recompute repeats each block's attention core, the work ``flops_per_token`` counts for
    it, in the op costs that time the zero-bubble schedules (planted: the whole attention half, its
    projections included, passed)."""
    cfg = _config(6, 2, 1)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, recompute="selective"))
    m = cfg.model
    block_forward = (flops_per_token(m) - 6 * m.hidden_size * m.vocab_size) / m.num_layers / 3
    core = (flops_per_token(m, "selective") - flops_per_token(m)) / m.num_layers / block_forward
    assert 0 < core < attention_share(m)
    assert _recomputed_by_stage(cfg) == pytest.approx([3 * core, 3 * core])


@pytest.mark.parametrize("split, every", [("[1.5, 2.5]", 2), ("[2.5, 1.5]", 3), ("[0.5, 3.5]", 2), ("[1.5, 1, 1.5]", 2)])
@pytest.mark.parametrize("dropout, refused", [("--model.attention_dropout", True), ("--model.dropout", True), (None, False)])
def test_the_recompute_refused_is_what_the_engine_refuses_of_its_built_blocks(split, every, dropout, refused):
    """tp 2 with full recompute of every k-th block, half blocks at the stage ends: the engine refuses
    (under torch.compile) when a checkpointed block of a rank's chunks draws dropout, counting from
    each chunk's first block. The first stage always checkpoints its first block, which holds block
    0's attention, so attention dropout alone is refused as surely as dropout on every branch, and a
    model without dropout never is; the planner's verdict, asked of each kind of block once, agrees."""
    from megazero.engine import build_chunks
    from megazero.planner.search import recompute_refused
    from models.parallelize import recompute_replays_tp_stream

    pp = len(split.split(","))
    cfg = resolve_config(load_config(None, ["--parallel.pipeline_split", split,
        "--model.num_layers", "4", "--model.hidden_size", "64", "--model.num_heads", "4", "--model.vocab_size", "500",
        "--model.seq_length", "32", "--parallel.tp", "2", "--parallel.pp", str(pp), "--parallel.recompute", "full",
        "--parallel.recompute_every", str(every), "--train.global_batch_size", "8", *([dropout, "0.1"] if dropout else [])]),
        2 * pp, 2 * pp)
    engine = any(recompute_replays_tp_stream(chunk, "full", every) for rank in range(pp) for chunk in build_chunks(cfg, rank))
    assert engine == refused
    assert recompute_refused(cfg, on_cuda=True) == refused


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_with_dropout_on_one_tensor_rank_is_not_refused(recompute):
    """Without tensor parallelism dropout draws from the default generator, which recompute restores
    itself: a compiled run recomputes such blocks, and the plan keeps those layouts."""
    from megazero.planner.search import recompute_refused

    cfg = resolve_config(load_config(None, [
        "--model.num_layers", "4", "--model.hidden_size", "64", "--model.num_heads", "4", "--model.vocab_size", "500",
        "--model.seq_length", "32", "--parallel.recompute", recompute, "--model.dropout", "0.1",
        "--train.global_batch_size", "8"]), 1, 1)
    assert not recompute_refused(cfg, on_cuda=True)
