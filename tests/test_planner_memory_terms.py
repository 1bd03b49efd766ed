"""The planner's memory terms against figures worked out by hand from their formulas (docs/planner.md):
the peak and its margins, the vocabulary padding a tensor rank holds, the model states of a pipeline
under ZeRO 2 and under optimizer offload, and the gradients no forward runs beside.

The model is a small GPT (4 blocks of width 64, learned positions, LayerNorm, biases, tied
embeddings), whose parameters are counted here by hand: a block holds its QKV, projection and two
MLP matrices with their biases and two LayerNorms, 12h^2 + 13h."""

import pytest

from megazero.config import load_config, resolve_config
from megazero.planner.hardware import GIB
from megazero.planner.memory import (MemoryEstimate, activation_bytes, estimate_memory, grads_outside_forward,
                                     layer_activation_bytes, micro_batch_counts, model_state_bytes, rank_params)

H, LAYERS, SEQ = 64, 4, 32
BLOCK = 12 * H * H + 13 * H


def config(world, *overrides):
    return resolve_config(load_config(None, [
        "--model.num_layers", str(LAYERS), "--model.hidden_size", str(H), "--model.num_heads", "4",
        "--model.seq_length", str(SEQ), "--model.vocab_size", "512", "--precision.dtype", "bf16",
        "--train.micro_batch_size", "1", *overrides]), world, world)


def test_peak_is_the_activations_or_the_optimizer_steps_and_needed_adds_the_margins():
    """With gradients released before the forward, the optimizer step (all model states) can be the
    peak rather than the activations beside the rest: max(10 - 4 + 1, 10) + 2 = 12 GiB; with more
    activations 10 - 4 + 6 + 2 = 14. Needed adds 10% fragmentation and 1.5 GiB outside the allocator."""
    optimizer_bound = MemoryEstimate(10 * GIB, 1 * GIB, 2 * GIB, 0, grads_outside_forward=4 * GIB)
    activation_bound = MemoryEstimate(10 * GIB, 6 * GIB, 2 * GIB, 0, grads_outside_forward=4 * GIB)
    assert optimizer_bound.peak == pytest.approx(12 * GIB)
    assert activation_bound.peak == pytest.approx(14 * GIB)
    assert optimizer_bound.needed == pytest.approx((12 * 1.1 + 1.5) * GIB)


def test_a_tensor_rank_holds_its_share_of_the_vocabulary_padded_to_128_times_tp():
    """Vocabulary 600 at tp 2 pads to 768 rows (a multiple of 256), not 640 (of 128): 384 a rank.
    Per tensor rank a block holds half its matrices and column biases (12h^2 + 7h) and whole its
    norms and row-parallel biases (6h); then the learned positions and the final norm."""
    cfg = config(2, "--parallel.tp", "2", "--model.vocab_size", "600")
    blocks = LAYERS * ((12 * H * H + 7 * H) / 2 + 6 * H)
    assert rank_params(cfg, 0) == pytest.approx(blocks + 768 * H / 2 + SEQ * H + 2 * H)


def _pipeline(*overrides):
    """pp 2 x dp 2, blocks split [2, 2], one micro-batch a step on each data-parallel rank."""
    return config(4, "--parallel.pp", "2", "--parallel.pipeline_split", "[2, 2]", "--train.global_batch_size", "2",
                  *overrides)


# rank 0: two blocks, the embedding and the positions; rank 1: two blocks, the final norm and the
# tied head's own copy of the embedding (a pipeline's head is in another chunk)
PIPELINE_PARAMS = (2 * BLOCK + 512 * H + SEQ * H, 2 * BLOCK + 2 * H + 512 * H)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_2_and_3_under_a_pipeline_keep_whole_fp32_gradients_and_bf16_parameters(stage):
    """A pipeline reduces once a step, so each rank keeps its whole fp32 gradients (4 bytes a
    parameter), beside the sharded master and moments (12 / dp) and whole bf16 parameters (2): stage
    3 gathers each unit at its first use and keeps it to the step."""
    cfg = _pipeline("--zero.stage", str(stage))
    for rank, numel in enumerate(PIPELINE_PARAMS):
        assert model_state_bytes(cfg, rank) == pytest.approx(numel * (2 + 4 + 12 / 2)), rank


OUTSIDE_BLOCKS = 512 * H + SEQ * H + 2 * H  # embedding, positions, final norm: stage 3's persistent unit


@pytest.mark.parametrize("stage, per_param", [(2, 2 + 4 / 2), (3, 2 / 2 + 4 / 2)])
def test_offloaded_optimizer_leaves_parameters_and_gradients_on_the_device(stage, per_param):
    """Master and moments live on the host: the device holds bf16 parameters (whole, or the shard
    stage 3 keeps for the host's update, and its persistent unit gathered whole to the step) and the
    fp32 gradient shard, nothing else."""
    cfg = config(2, "--zero.stage", str(stage), "--zero.offload_optimizer", "true", "--train.global_batch_size", "2")
    numel = LAYERS * BLOCK + OUTSIDE_BLOCKS
    persistent = 2 * OUTSIDE_BLOCKS if stage == 3 else 0
    assert model_state_bytes(cfg, 0) == pytest.approx(numel * per_param + persistent)


def test_stage_3_persistent_unit_takes_the_block_tensors_under_the_threshold():
    """zero.persistence_threshold 100 keeps each block's two norms' weights and biases and its
    attention and MLP output biases (6 tensors of h = 64 elements) whole beside the embedding; the
    column biases (3h and 4h) and matrices are gathered per block."""
    from megazero.planner.memory import persistent_params

    cfg = config(2, "--zero.stage", "3", "--zero.persistence_threshold", "100", "--train.global_batch_size", "2")
    assert persistent_params(cfg, 0) == pytest.approx(OUTSIDE_BLOCKS + LAYERS * 6 * H)


def test_whole_gradients_of_a_pipeline_are_not_beside_a_lone_micro_batchs_forward():
    """Under a pipeline, stages 2 and 3 keep whole gradient buffers, taken back by the backward: with
    one micro-batch a step no forward runs beside them. On the head's rank the unit outside the blocks
    is taken back as the backward starts, so only its blocks' gradients (fp32) count."""
    for stage in (1, 2, 3):
        cfg = _pipeline("--zero.stage", str(stage))
        assert [grads_outside_forward(cfg, rank) for rank in range(2)] == pytest.approx(
            [4 * PIPELINE_PARAMS[0], 4 * 2 * BLOCK]), stage
    # without a pipeline stage 2 reduces each gradient as it comes: no whole buffer to leave out
    assert grads_outside_forward(config(2, "--zero.stage", "2", "--train.global_batch_size", "2"), 0) == 0


def test_a_block_without_dropout_keeps_no_masks_and_gqa_keeps_its_narrower_keys_and_values():
    """Bytes a block keeps per token (bf16, tp 1): each half its norm's and linear's inputs (2 x 2h),
    then attention Q, K, V and its output (q + 2 kv + q elements: 64 + 2 x 32 + 64 with 2 of 4 heads
    for keys and values) and SwiGLU's gate and up outputs and the down matrix's input (3f, f = 128);
    no dropout, so no one-byte masks."""
    from megazero.planner.memory import layer_activation_bytes

    cfg = config(1, "--model.num_kv_heads", "2", "--model.activation", "swiglu", "--model.ffn_hidden_size", "128",
                 "--train.micro_batch_size", "2", "--train.global_batch_size", "2")
    attention = 2 * 2 * H + 2 * (64 + 2 * 32 + 64)
    mlp = 2 * 2 * H + 2 * 3 * 128
    assert layer_activation_bytes(cfg, False) == pytest.approx(SEQ * 2 * (attention + mlp))


def test_the_head_rank_keeps_its_share_of_the_logits_under_tensor_parallelism():
    """tp 2 without sequence parallelism, one micro-batch of 2 in flight: each block keeps per token
    its halves' norm and linear inputs whole (4 x 2h bytes) and its split tensors halved (12h
    elements: Q, K, V, attention output, then the MLP's 4h and 4h, at 2 bytes over 2 ranks); the head
    adds the final hidden state and its norm's output (2 x 2h) and this rank's 256 of the 512 logits."""
    from megazero.planner.memory import activation_bytes

    cfg = config(2, "--parallel.tp", "2", "--train.micro_batch_size", "2", "--train.global_batch_size", "2")
    block = 4 * 2 * H + 12 * H * 2 / 2
    assert activation_bytes(cfg, 0) == pytest.approx(SEQ * 2 * (LAYERS * block + 2 * 2 * H + 2 * 512 / 2))


def test_sharded_gradients_hold_four_scratch_buckets_of_at_most_a_units_gradients():
    """Where gradients are reduce-scattered every backward (stages 2-3 without a pipeline): four
    buckets (two reducing, one filling, one a late gradient keeps open), each no larger than the
    largest unit's gradients (a block's 12h^2 + 13h here, fp32 or bf16), a single data-parallel rank
    too (it reduces into scratch alike); none where whole gradient buffers reduce in place (stages
    0-1, a pipeline). Stage 3 adds the gathered block and the one prefetched, at dp 1 too."""
    from megazero.planner.memory import buffer_bytes

    def buffers(world, *overrides):
        return buffer_bytes(config(world, "--train.global_batch_size", str(world), *overrides), 0)
    assert buffers(2, "--zero.stage", "2") == pytest.approx(4 * 4 * BLOCK)
    assert buffers(2, "--zero.stage", "2", "--precision.accumulate_fp32", "false") == pytest.approx(4 * 2 * BLOCK)
    assert buffers(2, "--zero.stage", "2", "--zero.bucket_size_mb", "0.1") == pytest.approx(4 * 0.1 * 2**20)
    assert buffers(1, "--zero.stage", "2") == pytest.approx(4 * 4 * BLOCK)
    assert buffers(1, "--zero.stage", "3") == pytest.approx(4 * 4 * BLOCK + 2 * 2 * BLOCK)
    assert buffers(2, "--zero.stage", "1") == buffers(2, "--zero.stage", "0") == 0
    assert buffer_bytes(_pipeline("--zero.stage", "3"), 0) == 0


def test_the_estimate_says_sizes_below_a_gib_in_mib():
    """A small model's estimate read '0.0 GiB' for every part."""
    from megazero.planner.memory import GIB, MemoryEstimate

    est = MemoryEstimate(model_states=25 * 2**20, activations=1.25 * GIB, buffers=0.0, pp_rank=0)
    assert est.describe() == ("1.3 GiB per GPU (model states 25 MiB, activations 1.2 GiB, buffers 0 MiB; "
                              "2.9 GiB with margins)")
    assert est.describe("rank", margins=False) == ("1.3 GiB per rank (model states 25 MiB, activations 1.2 GiB, "
                                                   "buffers 0 MiB)")
    whole = MemoryEstimate(model_states=GIB, activations=0.0, buffers=0.0, pp_rank=0)
    assert whole.describe(margins=False) == "1.0 GiB per GPU (model states 1.0 GiB, activations 0 MiB, buffers 0 MiB)"


def test_a_batch_ramp_up_counts_its_fullest_step_not_the_full_batchs():
    """Interleaved 1F1B runs every forward first when a step's micro-batches are not a multiple of pp.
    pp 2 with two chunks a rank (one block each), a full batch of 8 micro-batches: the last rank holds
    five chunks' worth of blocks at its fullest. A ramp from 3 by 1 passes through 7, where it holds
    all 14 chunks beside the head's logits, and the estimate is that step's. 1F1B's in-flight count
    only grows with the step's micro-batches, so there a ramp changes nothing."""
    interleaved = ["--parallel.pp", "2", "--parallel.virtual_stages", "2", "--train.global_batch_size", "8"]
    ramp = ["--schedule.rampup_start_batch", "3", "--schedule.rampup_increment", "1", "--schedule.rampup_samples", "100"]
    full, ramped = config(2, *interleaved), config(2, *interleaved, *ramp)
    block = layer_activation_bytes(full, False)
    assert micro_batch_counts(ramped) == [8, 7, 6, 5, 4, 3] and micro_batch_counts(full) == [8]
    assert activation_bytes(ramped, 1, 7) == pytest.approx(14 * block + activation_bytes(ramped, 1, 1) - 2 * block)
    estimate = estimate_memory(ramped)
    assert (estimate.pp_rank, estimate.activations) == (1, pytest.approx(activation_bytes(ramped, 1, 7)))
    assert estimate_memory(full).activations < estimate.activations / 2
    one_f_one_b = ["--parallel.pp", "2", "--train.global_batch_size", "8"]
    assert estimate_memory(config(2, *one_f_one_b, *ramp)) == estimate_memory(config(2, *one_f_one_b))
