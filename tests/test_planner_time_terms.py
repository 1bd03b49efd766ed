"""The planner's step-time terms against figures worked out by hand from docs/planner.md: the
optimizer step's bytes over HBM, the data-parallel traffic each ZeRO stage exposes with and without
overlap, the tensor-parallel all-reduces (recomputed forwards included), the host-bound stage, the
1F1B bubble, the zero-bubble schedules' idle against their busiest rank, MFU against hardware
TFLOP/s, and each micro-batch's fixed cost (by hand, and against a measured micro-batch sweep of GPT
1.3B on one H200).

The model is a small GPT (4 blocks of width 64, vocabulary 512, sequence 32, bf16, fp32 gradient
accumulation) with 12h^2 + 13h parameters a block, counted by hand; its FLOPs per token come from
``flops_per_token``, itself checked by hand in test_metrics."""

import dataclasses

import pytest

from megazero.config import load_config, resolve_config
from megazero.flops import flops_per_token
from megazero.planner import GPUS, Cluster, estimate_step
from megazero.planner.hardware import custom_gpu

H, LAYERS, SEQ, VOCAB = 64, 4, 32, 512
NUMEL = LAYERS * (12 * H * H + 13 * H) + VOCAB * H + SEQ * H + 2 * H  # blocks, embedding, positions, final norm
# 989 TFLOP/s at 0.62, HBM 3350 GB/s, NVLink 450 GB/s (0.45 for tensor parallelism); without the fixed cost
# of a micro-batch, which has its own test, so that each other term shows alone
H100 = dataclasses.replace(GPUS["h100"], block_overhead_s=None)
LINK = 0.8  # what a link delivers of its datasheet figure


def config(world, *overrides):
    return resolve_config(load_config(None, [
        "--model.num_layers", str(LAYERS), "--model.hidden_size", str(H), "--model.num_heads", "4",
        "--model.seq_length", str(SEQ), "--model.vocab_size", str(VOCAB), "--precision.dtype", "bf16",
        "--train.micro_batch_size", "1", *overrides]), world, world)


@pytest.mark.parametrize("mbs, recompute, grad_bytes", [(1, "none", 4), (4, "none", 4), (1, "full", 4), (1, "none", 2)])
def test_a_micro_batch_costs_its_weights_traffic_and_its_blocks_whatever_its_tokens(mbs, recompute, grad_bytes):
    """Per micro-batch: each bf16 weight read twice (forward, input gradient) and each fp32 gradient read
    and written (12 bytes a parameter; 8 with bf16 gradients) at 80% of 3350 GB/s, plus 0.26 ms a block (a
    recomputed forward a third of that), on top of the FLOPs; the same for 1 sequence or 4 (planted: the
    traffic counted once per step, not per micro-batch; recomputed blocks left out)."""
    cfg = config(1, "--train.micro_batch_size", str(mbs), "--train.global_batch_size", str(4 * mbs),
                 "--parallel.recompute", recompute, "--precision.accumulate_fp32", str(grad_bytes == 4).lower())
    with_fixed, flops_only = (estimate_step(cfg, Cluster(gpu, 1, 1)).compute_s for gpu in (GPUS["h100"], H100))
    fixed = with_fixed - flops_only
    blocks = LAYERS * (4 / 3 if recompute == "full" else 1)
    assert fixed == pytest.approx(4 * (NUMEL * (4 + 2 * grad_bytes) / (3350e9 * 0.8) + blocks * 0.26e-3))


def test_each_pipeline_rank_pays_for_its_own_weights_and_blocks():
    """pp 2 split [3, 1]: the first rank's fixed cost is its three blocks, embedding and positions, the
    second's its one block and final norm (the head is tied to the embedding on the first rank, whose
    copy the second holds too)."""
    from megazero.planner.memory import rank_params
    from megazero.planner.time import _micro_batch_fixed_s

    cfg = config(2, "--parallel.pp", "2", "--parallel.pipeline_split", "[3, 1]", "--train.global_batch_size", "4")
    for rank, blocks in ((0, 3), (1, 1)):
        expected = rank_params(cfg, rank) * 12 / (3350e9 * 0.8) + blocks * 0.26e-3
        assert _micro_batch_fixed_s(cfg, GPUS["h100"], rank, blocks) == pytest.approx(expected)
    assert rank_params(cfg, 0) > 3 * (12 * H * H + 13 * H) > rank_params(cfg, 1)


@pytest.mark.parametrize("stage, accumulate_fp32", [(0, True), (1, True), (2, True), (3, True), (1, False)])
def test_optimizer_step_streams_its_shard_through_hbm(stage, accumulate_fp32):
    """Per shard element: master and two moments read and written (24 bytes), the fp32 gradient read
    (4, or 2 for bf16 gradients) and the bf16 parameter written (2), at 80% of 3350 GB/s; ZeRO 1-3
    shard over dp 2."""
    cfg = config(2, "--zero.stage", str(stage), "--train.global_batch_size", "2",
                 "--precision.accumulate_fp32", str(accumulate_fp32).lower())
    shard = NUMEL / (2 if stage else 1)
    per_element = 24 + (4 if accumulate_fp32 else 2) + 2
    assert estimate_step(cfg, Cluster(H100, 2, 2)).optimizer_s == pytest.approx(shard * per_element / (3350e9 * 0.8))


def _data_parallel(stage, overlap):
    """dp 2 within a node of GPUs doing 1 GFLOP/s over 10 MB/s links, two micro-batches a step: a
    micro-batch's compute and the gradients' traffic are then of a size."""
    gpu = custom_gpu(H100, peak_tflops=0.001, intra_node_GBps=0.01)
    cfg = config(2, "--zero.stage", str(stage), "--zero.overlap_comm", str(overlap).lower(),
                 "--train.global_batch_size", "4")
    bw = 0.01e9 * LINK
    reduce_scatter, gather = NUMEL / 2 * 4 / bw, NUMEL / 2 * 2 / bw  # (d-1)/d of fp32 gradients, bf16 parameters
    compute = SEQ * flops_per_token(cfg.model) / (0.001e12 * H100.efficiency)
    return estimate_step(cfg, Cluster(gpu, 2, 2)).dp_comm_s, reduce_scatter, gather, compute


OUTSIDE_BLOCKS = (VOCAB + SEQ + 2) * H  # embedding, positions, final norm: stage 3's persistent unit


def _stage_3(rs, gather, c):
    """Stage 3 without a pipeline, two micro-batches: the persistent unit's gather, synchronous as the
    forward starts, once a step; each micro-batch the blocks' gathers for its forward and backward and
    its gradients' reduce-scatter, behind its compute."""
    persistent = gather * OUTSIDE_BLOCKS / NUMEL
    return persistent + 2 * (2 * (gather - persistent) + rs - c)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_overlap_comm_off_exposes_the_whole_gradient_reductions_only(stage):
    """``zero.overlap_comm false`` starts the once-a-step reductions after the backward (stage 0's
    all-reduce, stage 1's reduction: all exposed); the wrapper overlaps everything else all the same
    (stage 1-2 gathers behind the next forward, stage 2's per-micro-batch reduce-scatters behind each
    backward, stage 3's block traffic behind each micro-batch), and so does the model."""
    exposed, rs, gather, c = _data_parallel(stage, overlap=False)
    expected = {0: 2 * rs, 1: rs + gather - c / 3, 2: 2 * (rs - 2 * c / 3) + gather - c / 3,
                3: _stage_3(rs, gather, c)}[stage]
    assert exposed == pytest.approx(expected)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_data_parallel_traffic_hides_behind_the_backward_and_forward(stage):
    """With overlap, the reduction hides behind the last backward (2/3 of a micro-batch's compute c),
    the gather behind the next forward (c/3), stage 2's per-micro-batch reduction behind each
    backward, stage 3's block traffic behind each whole micro-batch (its persistent unit's gather
    behind nothing: planted, it was gathered with the blocks twice a micro-batch)."""
    exposed, rs, gather, c = _data_parallel(stage, overlap=True)
    assert 2 * c / 3 < rs and c / 3 < gather  # every term still shows
    expected = {0: 2 * rs - 2 * c / 3, 1: rs - 2 * c / 3 + gather - c / 3, 2: 2 * (rs - 2 * c / 3) + gather - c / 3,
                3: _stage_3(rs, gather, c)}[stage]
    assert exposed == pytest.approx(expected)


@pytest.mark.parametrize("recompute, every, all_reduces", [("none", 1, 4 * 4), ("full", 1, 4 * 4 + 2 * 4),
                                                           ("full", 2, 4 * 4 + 2 * 2)])
def test_tensor_parallel_all_reduces_per_block_and_recomputed_forward(recompute, every, all_reduces):
    """tp 2: four all-reduces a block (two forward, two backward) and two more in each recomputed
    forward (every block, or blocks 0 and 2 of 4), each moving 2(t-1)/t of a micro-batch's bf16
    activations (2 x 32 tokens x 64) over NVLink at the tensor-parallel efficiency."""
    cfg = config(2, "--parallel.tp", "2", "--parallel.recompute", recompute, "--parallel.recompute_every", str(every),
                 "--train.micro_batch_size", "2", "--train.global_batch_size", "2")
    all_reduce = 2 * (2 - 1) / 2 * 2 * (SEQ * 2) * H / (450e9 * H100.tp_link_efficiency)
    assert estimate_step(cfg, Cluster(H100, 2, 2)).tp_comm_s == pytest.approx(all_reduces * all_reduce)


@pytest.mark.parametrize("pp, split, blocks, vocab", [(1, None, 4, VOCAB), (2, "[1, 3]", 3, VOCAB),
                                                     (2, "[3, 1]", 3, 32768)])
def test_a_host_bound_stage_takes_the_hosts_time(pp, split, blocks, vocab):
    """A tensor-parallel model this small, its blocks not replayed as graphs, waits on the host: each
    micro-batch of the busiest stage takes 6 ms a block, its compute and tensor-parallel traffic
    inside that, whichever rank it is (the last, with 3 of the 4 blocks; or the first, with 3, while
    the last, with one block and a head of 32768 words, 39 blocks' work, is the GPUs' slowest)."""
    extra = ["--parallel.pipeline_split", split] if split else []
    cfg = config(2 * pp, "--parallel.tp", "2", "--parallel.pp", str(pp), "--train.global_batch_size", "4",
                 "--model.vocab_size", str(vocab), *extra)
    est = estimate_step(cfg, Cluster(H100, 2 * pp, 2 * pp))
    assert est.host_s > 0
    assert est.compute_s + est.tp_comm_s + est.host_s == pytest.approx(4 * blocks * 6e-3)


def test_the_1f1b_bubble_is_p_minus_1_over_m_of_the_useful_time():
    """pp 2, 4 micro-batches a step: (p - 1)/m = 1/4 of the slowest stage's time for the 4."""
    est = estimate_step(config(2, "--parallel.pp", "2", "--train.global_batch_size", "4"), Cluster(H100, 2, 2))
    assert est.bubble_s == pytest.approx((est.compute_s + est.tp_comm_s + est.host_s + est.pp_comm_s) / 4)


def test_mfu_counts_the_models_flops_and_tflops_the_recomputed_ones_too():
    """Full recompute of every block: TFLOP/s per GPU counts each block's forward again (the FLOPs
    executed), MFU the model's alone against the dense peak, over the step's 2 x 32 tokens on 2 GPUs."""
    cfg = config(2, "--parallel.recompute", "full", "--train.global_batch_size", "2")
    est = estimate_step(cfg, Cluster(H100, 2, 2))
    tokens_per_gpu_s = 2 * SEQ / est.step_s / 2
    assert est.tflops_per_gpu == pytest.approx(flops_per_token(cfg.model, "full") * tokens_per_gpu_s / 1e12)
    assert est.mfu == pytest.approx(flops_per_token(cfg.model) * tokens_per_gpu_s / 989e12)


BLOCK = 12 * H * H + 13 * H
HEAD_RANK_PARAMS = 2 * BLOCK + 2 * H + VOCAB * H  # two blocks, the final norm, the tied head's own copy


def test_a_data_parallel_group_strided_across_nodes_takes_infiniband():
    """tp-pp-dp on nodes of 2: the pipeline's two ranks are neighbours, the data-parallel pair 2
    apart, on two nodes; without overlap stage 0 under a pipeline all-reduces the head rank's fp32
    gradients once, all exposed, over its 50 GB/s InfiniBand share."""
    cfg = config(4, "--parallel.pp", "2", "--parallel.order", "tp-pp-dp", "--parallel.pipeline_split", "[2, 2]",
                 "--zero.stage", "0", "--zero.overlap_comm", "false", "--train.global_batch_size", "4")
    bw = 50e9 * LINK
    expected = 2 * HEAD_RANK_PARAMS / 2 * 4 / bw
    assert estimate_step(cfg, Cluster(H100, 4, 2)).dp_comm_s == pytest.approx(expected)


def test_a_data_parallel_group_that_starts_near_a_nodes_end_takes_infiniband():
    """24 GPUs at 8 a node, tp 2 x dp 3 x pp 4: each data-parallel group is 6 ranks wide, but the one
    of ranks 6, 8 and 10 spans nodes 0 and 1, so the kind's traffic is InfiniBand's, as on nodes of one
    GPU; on nodes of 12 every group sits in one and takes NVLink. (Planted: stride x size within a
    node's width taken for in-node, the step as fast as on nodes of 12.)"""
    cfg = config(24, "--parallel.tp", "2", "--parallel.pp", "4", "--zero.stage", "0", "--zero.overlap_comm", "false",
                 "--train.global_batch_size", "12")
    assert (cfg.parallel.dp, cfg.parallel.order) == (3, "tp-dp-pp")
    at_8, at_1, at_12 = (estimate_step(cfg, Cluster(H100, 24, per_node)).dp_comm_s for per_node in (8, 1, 12))
    assert at_8 == pytest.approx(at_1) and at_12 == pytest.approx(at_8 * 50 / 450)


def test_interleaving_reduces_after_the_last_backward_and_stage_3_pipelines_gather_once_a_step():
    """On slow GPUs over NVLink: interleaved (two chunks a rank) ZeRO 1 reduces after the last
    backward, hiding none of it, while its gather still hides behind the next forward. One chunk a
    rank under ZeRO 3 keeps each unit gathered from its first use to the step: the head rank gathers
    its final norm and head as its forward starts (exposed), its blocks once a step behind the first
    forward, and reduces behind the last backward; without ``zero.overlap_comm`` that reduction shows
    whole. (Planted: its blocks were charged two gathers a micro-batch, as without a pipeline.)"""
    gpu = custom_gpu(H100, peak_tflops=0.001)
    interleaved = config(4, "--parallel.pp", "2", "--parallel.virtual_stages", "2", "--parallel.pipeline_split",
                         "[1, 1, 1, 1]", "--train.global_batch_size", "8")
    reduce_scatter = HEAD_RANK_PARAMS / 2 * 4 / (450e9 * LINK)
    assert estimate_step(interleaved, Cluster(gpu, 4, 4)).dp_comm_s == pytest.approx(reduce_scatter)
    head_gather = (2 * H + VOCAB * H) / 2 * 2 / (450e9 * LINK)
    stage3 = config(4, "--parallel.pp", "2", "--zero.stage", "3", "--parallel.pipeline_split", "[2, 2]",
                    "--train.global_batch_size", "8")
    assert estimate_step(stage3, Cluster(gpu, 4, 4)).dp_comm_s == pytest.approx(head_gather)
    slow_link = custom_gpu(H100, peak_tflops=0.001, intra_node_GBps=0.005)  # 90,000 times slower
    slow = estimate_step(stage3, Cluster(slow_link, 4, 4))
    c = slow.compute_s / 4  # a micro-batch's compute: a third forward, two thirds backward
    block_gather = 2 * BLOCK / 2 * 2 / (0.005e9 * LINK)
    assert block_gather > c / 3 and reduce_scatter * 90000 > 2 * c / 3
    assert slow.dp_comm_s == pytest.approx(90000 * head_gather + block_gather - c / 3 + 90000 * reduce_scatter - 2 * c / 3)
    # the same stage 3 pipeline without overlap: its once-a-step reduction, after the backward, all shows
    unhidden = config(4, "--parallel.pp", "2", "--zero.stage", "3", "--zero.overlap_comm", "false",
                      "--parallel.pipeline_split", "[2, 2]", "--train.global_batch_size", "8")
    assert estimate_step(unhidden, Cluster(gpu, 4, 4)).dp_comm_s == pytest.approx(head_gather + reduce_scatter)


def test_selective_recompute_repeats_the_attention_cores_of_a_ranks_own_blocks():
    """pp 2 split [2, 2]: the head's rank computes its two blocks' forward and backward, their two
    attention cores again (half the model's selective extra), and the head, for 4 micro-batches."""
    cfg = config(2, "--parallel.pp", "2", "--parallel.pipeline_split", "[2, 2]", "--parallel.recompute", "selective",
                 "--train.global_batch_size", "4")
    model, selective = flops_per_token(cfg.model), flops_per_token(cfg.model, "selective")
    head = 6 * H * VOCAB
    per_token = (model - head) / 2 + (selective - model) / 2 + head
    expected = 4 * SEQ * per_token / (989e12 * H100.efficiency)
    assert estimate_step(cfg, Cluster(H100, 2, 2)).compute_s == pytest.approx(expected)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2"])
def test_a_timed_zero_bubble_idle_is_over_the_busiest_ranks_work(schedule):
    """Two ranks, the second twice as heavy (forward, input and weight gradient 2 each against 1), four
    micro-batches: the second rank starts after the first's forward (1) and is never starved after,
    so the step is 1 + 4 x 6 = 25 and the busiest rank's 24 idle 1/24 of it. Measured against the
    lighter rank's 12 it would read as 13/12, a bubble longer than the work."""
    from megazero.planner.time import _timed_idle
    from parallel.pipeline.plan import StageCosts

    costs = StageCosts(((1.0, 1.0, 1.0), (2.0, 2.0, 2.0)), (1.0, 1.0))
    assert _timed_idle(schedule, 2, 4, costs) == pytest.approx(1 / 24)


# One H200, GPT 1.3B compiled, ZeRO 0, 16 sequences a step (BENCHMARKS.md, "The planner's micro-batch
# term"): step ms by micro-batch size (micro-batch 8: the mean of the call's two runs).
MEASURED_MICRO_BATCH_STEP_MS = {1: 665.9, 2: 571.6, 4: 537.5, 8: 515.55, 16: 512.8}


def test_smaller_micro_batches_run_slower_as_measured():
    """Each micro-batch reads every weight and accumulates every gradient whatever its tokens, so the
    same 16 sequences take 1.29 times as long in micro-batches of 1 as of 8; the planner once gave
    every micro-batch size the same speed (planted: the fixed cost left out, or counted per step)."""
    steps = {}
    for mbs, measured in MEASURED_MICRO_BATCH_STEP_MS.items():
        cfg = resolve_config(load_config("configs/gpt_1.3b.yaml", [
            "--train.micro_batch_size", str(mbs), "--train.global_batch_size", "16", "--zero.stage", "0"]), 1, 1)
        steps[mbs] = estimate_step(cfg, Cluster(GPUS["h200"], 1, 1)).step_s * 1e3
        assert steps[mbs] == pytest.approx(measured, rel=0.03), mbs
    assert steps[1] > steps[2] > steps[4] > steps[8] > steps[16]
