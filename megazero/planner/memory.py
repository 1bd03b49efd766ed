"""Per-GPU memory of a layout: model states (the ZeRO formula), activations, buffers.

Each pipeline rank holds different things (the first the embedding and the most micro-batches in
flight, the last the head and the logits), so the estimate is made for the first and the last rank
and the larger is the run's. See docs/planner.md for every term and where it comes from.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

from megazero.config.schema import Config
from megazero.engine import (head_rank, pipeline_costs, pipeline_placement, pipeline_schedule, pipeline_split,
                             reduces_once_per_step, stage_recomputed_work)
from megazero.flops import attention_share
from megazero.optim.memory import ModelStateBytes, zero_model_state_bytes
from megazero.planner.hardware import GIB
from megazero.training_schedules import build_batch_schedule
from models.config import ModelConfig
from models.embedding import padded_vocab_size
from parallel.data_parallel.grads import MAX_IN_FLIGHT
from parallel.pipeline.partition import BLOCK_PARTS, rank_work as split_rank_work, stage_layers, stage_parts
from parallel.pipeline.placement import stage_of
from parallel.pipeline.plan import StageCosts, schedule_for
from parallel.pipeline.ramp import fullest_counts
from parallel.pipeline.schedule import SPLIT_BACKWARD, live_peaks, weighted_peak

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# The caching allocator's fragmentation and the memory outside it (CUDA context, cuBLAS and NCCL
# workspaces): a layout fits when peak * (1 + FRAGMENTATION) + RUNTIME_RESERVED_GIB <= device memory.
# The ZeRO paper (section VI-C) names fragmentation as what makes a run that fits on paper fail;
# 10% and 1.5 GiB are this project's margins, not a published figure.
FRAGMENTATION = 0.10
RUNTIME_RESERVED_GIB = 1.5

SCRATCH_BUCKETS = MAX_IN_FLIGHT + 2
"""Gradient scratch buffers sharded reduction holds at once: the reductions in flight, the bucket
filling and one a late gradient keeps open (the embedding's, which the backward reaches last);
measured on the engine for every bucket size, vocabulary and tying tried."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the fullest pipeline rank (``pp_rank``)."""

    model_states: float
    activations: float
    buffers: float
    pp_rank: int
    grads_outside_forward: float = 0.0  # gradient bytes (in model_states) that no forward runs beside

    @property
    def peak(self) -> float:
        """What the allocator holds at the peak of a step (comparable to ``torch.cuda.max_memory_allocated``):
        the activations' peak beside the model states held then, or the optimizer step's."""
        beside_activations = self.model_states - self.grads_outside_forward + self.activations
        return max(beside_activations, self.model_states) + self.buffers

    @property
    def needed(self) -> float:
        """Device memory the layout needs, margins included."""
        return self.peak * (1 + FRAGMENTATION) + RUNTIME_RESERVED_GIB * GIB

    def describe(self, per: str = "GPU", margins: bool = True) -> str:
        """The estimate as the start-up line says it, ``per`` GPU or rank, with the margins (which stand
        for the CUDA runtime and its allocator) where a budget is measured against them."""
        released = (f", of which gradients {_size(self.grads_outside_forward)} not held beside the activations"
                    if self.grads_outside_forward else "")
        with_margins = f"; {_size(self.needed)} with margins" if margins else ""
        return (f"{_size(self.peak)} per {per} (model states {_size(self.model_states)}{released}, "
                f"activations {_size(self.activations)}, buffers {_size(self.buffers)}{with_margins})")


def _size(nbytes: float) -> str:
    """GiB to one decimal, or MiB below one GiB (a small model's estimate read 0.0 GiB throughout)."""
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.0f} MiB"


def block_params(m: ModelConfig, parts: tuple[str, ...] = BLOCK_PARTS) -> tuple[int, int]:
    """(parameters tensor parallelism splits, parameters every tensor rank holds whole) of one block,
    or of the ``parts`` of it a stage holds (a split such as ``[12.5, 11.5]``)."""
    tensors = block_tensors(m, parts)
    return sum(n for n, split in tensors if split), sum(n for n, split in tensors if not split)


def block_tensors(m: ModelConfig, parts: tuple[str, ...] = BLOCK_PARTS) -> list[tuple[int, bool]]:
    """(elements, whether tensor parallelism splits it) of each parameter of one block's ``parts``:
    each half has its norm, its column-parallel linear (split, with its bias) and its row-parallel
    one (split; its bias not)."""
    h, q, kv, f = m.hidden_size, m.num_heads * m.head_dim, m.kv_heads * m.head_dim, m.ffn_size
    gates = 2 if m.activation == "swiglu" else 1
    widths = {"attention": (q + 2 * kv, q), "mlp": (f * gates, f)}  # (column outputs, row inputs)
    tensors = []
    for part in parts:
        columns, rows = widths[part]
        tensors += [(h, False)] * (norm_params(m) // h) + [(h * columns, True), (rows * h, True)]
        if m.bias:
            tensors += [(columns, True), (h, False)]
    return tensors


def norm_params(m: ModelConfig) -> int:
    """A LayerNorm has a bias exactly when the linear layers do; an RMSNorm never."""
    return 2 * m.hidden_size if m.norm == "layernorm" and m.bias else m.hidden_size


def rank_params(cfg: Config, pp_rank: int) -> float:
    """Parameters held by one tensor rank of pipeline rank ``pp_rank``: its blocks (a half block its
    half's), and the embedding (first virtual stage) and head (last) where they live."""
    m, p = cfg.model, cfg.parallel
    numel = rank_block_params(cfg, pp_rank)
    vocab_rows = padded_vocab_size(m.vocab_size, 128 * p.tp) * m.hidden_size / p.tp
    if pp_rank == 0:
        numel += vocab_rows + (m.seq_length * m.hidden_size if m.position_embedding == "learned" else 0)
    if pp_rank == head_rank(cfg):
        numel += norm_params(m)
        if not (m.tie_embeddings and p.pp == 1):
            numel += vocab_rows  # an untied head, or the tied head's copy in another chunk than the embedding
    return numel


def rank_chunks(cfg: Config, pp_rank: int) -> list[list[tuple[str, ...]]]:
    """For each chunk of pipeline rank ``pp_rank``, the parts it holds of each of its blocks:
    ``BLOCK_PARTS`` for a whole block, one of them for a block a split such as ``[12.5, 11.5]`` cuts."""
    p = cfg.parallel
    split, placement = pipeline_split(cfg), pipeline_placement(cfg)
    held = []
    for chunk in range(p.virtual_stages):
        parts = stage_parts(split, p.pp, pp_rank, chunk, placement)
        held.append([parts.get(i, BLOCK_PARTS) for i in stage_layers(split, p.pp, pp_rank, chunk, placement)])
    return held


def rank_blocks(cfg: Config, pp_rank: int) -> list[tuple[str, ...]]:
    """``rank_chunks``, its chunks one after another."""
    return [parts for chunk in rank_chunks(cfg, pp_rank) for parts in chunk]


def rank_block_params(cfg: Config, pp_rank: int) -> float:
    """Parameters of pipeline rank ``pp_rank``'s blocks on one tensor rank."""
    blocks = rank_blocks(cfg, pp_rank)
    # whole blocks counted once and multiplied: the planner asks this of every rank of thousands of
    # layouts, and 530B's ranks hold up to 105 blocks; a half block (at a chunk's ends) on its own
    halves = [parts for parts in blocks if parts != BLOCK_PARTS]
    return (len(blocks) - len(halves)) * _block_on_rank(cfg) + sum(_block_on_rank(cfg, parts) for parts in halves)


def rank_work(cfg: Config, pp_rank: int) -> float:
    """Blocks' worth of work pipeline rank ``pp_rank`` does: a block held in half counts its half's
    share (``attention_share``), so the time model sees what a half-block split moves."""
    return split_rank_work(pipeline_split(cfg), cfg.parallel.pp, pp_rank, attention_share(cfg.model),
                           pipeline_placement(cfg))


def rank_recomputed_work(cfg: Config, pp_rank: int) -> float:
    """Blocks' worth of forward work pipeline rank ``pp_rank`` repeats in its backward under full
    recompute: its chunks' ``stage_recomputed_work`` (GPT 6 x h at pp 2 and k 2 repeats 4 blocks, not 3)."""
    p = cfg.parallel
    if p.recompute != "full":
        return 0.0
    repeated, placement = stage_recomputed_work(cfg), pipeline_placement(cfg)
    return sum(repeated[stage_of(p.pp, pp_rank, chunk, placement)] for chunk in range(p.virtual_stages))


@functools.lru_cache(maxsize=1 << 16)
def _live_peaks(schedule: str, pp: int, pp_rank: int, micro: int, v: int, costs: Optional[StageCosts]) -> tuple:
    """``live_peaks`` of pipeline rank ``pp_rank``'s ops, as the engine builds them from the ranks' op
    ``costs``; remembered, as the planner asks for every rank of thousands of layouts."""
    return tuple(live_peaks(schedule_for(schedule, pp, pp_rank, micro, v, costs)))


def micro_batches(cfg: Config) -> int:
    """Micro-batches per step on each data-parallel rank, at the full batch."""
    t = cfg.train
    return max(1, t.global_batch_size // (t.micro_batch_size * cfg.parallel.dp))


def micro_batch_counts(cfg: Config) -> list[int]:
    """Every count of micro-batches a data-parallel rank's step runs, largest first: the full batch's,
    and under a batch ramp-up (``schedule.rampup_*``) each smaller one the ramp names. Most schedules
    hold the most in flight at the largest count, but interleaved 1F1B runs every forward first when
    the count is not a multiple of pp (``interleaved_warmup``), so a ramp's step can hold more."""
    if cfg.schedule.rampup_start_batch is None:
        return [micro_batches(cfg)]
    return build_batch_schedule(cfg.schedule, cfg.train, cfg.parallel.dp).micro_batch_counts()[::-1]


def _zero_states(cfg: Config, pp_rank: int) -> ModelStateBytes:
    p, z, prec = cfg.parallel, cfg.zero, cfg.precision
    param_bytes = DTYPE_BYTES[prec.dtype]
    grad_bytes = 4 if prec.accumulate_fp32 else param_bytes
    states = zero_model_state_bytes(rank_params(cfg, pp_rank), p.dp, z.stage, param_bytes=param_bytes,
                                    grad_bytes=grad_bytes, full_grads=reduces_once_per_step(cfg),
                                    param_shard=z.offload_optimizer)
    return dataclasses.replace(states, params=states.params + gathered_until_step(cfg, pp_rank) * param_bytes)


def gathered_until_step(cfg: Config, pp_rank: int) -> float:
    """Stage 3: elements of this rank's 16-bit parameters gathered whole at their first use and held
    to the optimizer step (``parallel/data_parallel/gather.py``). Where gradients are reduced once per
    step (a pipeline, or a split-backward schedule: ``reduces_once_per_step``) every unit is, so the
    rank holds all its parameters as stages 0-2 do; otherwise the persistent unit is."""
    if cfg.zero.stage < 3:
        return 0.0
    return rank_params(cfg, pp_rank) if reduces_once_per_step(cfg) else persistent_params(cfg, pp_rank)


def persistent_params(cfg: Config, pp_rank: int) -> float:
    """Elements of stage 3's persistent unit on one tensor rank, gathered as a pipeline chunk's forward
    starts: what no block holds (embedding, final norm, head) and the block tensors with fewer than
    ``zero.persistence_threshold`` elements on a tensor rank."""
    tp, threshold = cfg.parallel.tp, cfg.zero.persistence_threshold
    small = sum(on_rank for parts in rank_blocks(cfg, pp_rank) for numel, split in block_tensors(cfg.model, parts)
                for on_rank in [numel / tp if split else numel] if on_rank < threshold)
    return rank_params(cfg, pp_rank) - rank_block_params(cfg, pp_rank) + small


def model_state_bytes(cfg: Config, pp_rank: int) -> float:
    """The ZeRO formula for this rank's parameters, with megazero's dtypes: 16-bit (or fp32)
    parameters, fp32 gradients under ``precision.accumulate_fp32``, an fp32 copy of the gradient
    shard where gradients are 16-bit (an fp32 run's gradients are fp32 already, so it has none);
    master and moments on the host under offload."""
    states = _zero_states(cfg, pp_rank)
    if cfg.zero.offload_optimizer:
        return states.params + states.grads
    fp32_grads = cfg.precision.accumulate_fp32 or cfg.precision.dtype == "fp32"
    return states.total + (0.0 if fp32_grads else states.master)


def offloaded_bytes(cfg: Config) -> float:
    """Host bytes one rank's offloaded optimizer holds (the most of any pipeline rank's): its fp32
    master shard, that shard's fp32 gradient and the two Adam moments; 0 without offload. The
    device's formula leaves them out, so a layout that fits its GPUs only by offloading passed
    ``--check`` on hosts too small for it, and failed allocating them at the start."""
    if not cfg.zero.offload_optimizer:
        return 0.0
    return max(2 * states.master + states.optimizer for states in (_zero_states(cfg, r) for r in range(cfg.parallel.pp)))


def grads_outside_forward(cfg: Config, pp_rank: int, micro: Optional[int] = None) -> float:
    """Gradient bytes no activations' peak runs beside. Whole gradient buffers (stages 0-1, and stages
    2-3 reducing once per step) hold memory only from the backward that reaches them to the end of the step,
    so with one micro-batch per step no forward runs beside them; with more, later forwards run beside
    the gradients accumulated so far. Not with full recompute either: each block is rebuilt inside the
    backward, beside the gradients taken back by then. On the rank holding the head, the unit outside
    the blocks (final norm, head, a tied embedding) is taken back as the backward starts, beside every
    activation, so it counts. ``micro``: the step's micro-batches (default the full batch's)."""
    p, z = cfg.parallel, cfg.zero
    whole_buffers = z.stage < 2 or reduces_once_per_step(cfg)
    if (micro or micro_batches(cfg)) > 1 or not whole_buffers or p.recompute == "full":
        return 0.0
    grads = _zero_states(cfg, pp_rank).grads
    if pp_rank == head_rank(cfg):
        grads *= rank_block_params(cfg, pp_rank) / rank_params(cfg, pp_rank)
    return grads


def layer_activation_bytes(cfg: Config, recomputed: bool, parts: tuple[str, ...] = BLOCK_PARTS) -> float:
    """Bytes one block (or the ``parts`` of it a stage holds) keeps for backward per micro-batch
    (Korthikanti et al. 2022, section 4).

    Stored tensors, in elements per token and hidden unit: the two norm inputs, the QKV and first MLP
    linear inputs (4, replicated over tensor ranks unless sequence parallel), then Q, K, V, the
    attention output, the activation's input and the second MLP linear's input (split over tensor
    ranks), plus two one-byte dropout masks when dropout is on; each half keeps its own two inputs,
    its split tensors and its mask. Attention runs in a fused kernel (scaled_dot_product_attention),
    which keeps no s x s scores: Korthikanti's 5as/h term is absent. A recomputed block or half keeps
    only its input.
    """
    m, p = cfg.model, cfg.parallel
    e = DTYPE_BYTES[cfg.precision.dtype]
    sbh = m.seq_length * cfg.train.micro_batch_size * m.hidden_size
    sp = p.tp if p.sequence_parallel else 1
    if recomputed:
        return e * sbh / sp
    h, q, kv, f = m.hidden_size, m.num_heads * m.head_dim, m.kv_heads * m.head_dim, m.ffn_size
    gates = 2 if m.activation == "swiglu" else 1
    widths = {"attention": (q + 2 * kv) + q, "mlp": f * gates + f}
    mask = 1 if m.dropout > 0 else 0
    return sum(sbh * ((2 * e + mask) / sp + widths[part] / h * e / p.tp) for part in parts)


def activation_bytes(cfg: Config, pp_rank: int, micro: Optional[int] = None) -> float:
    """Activations on pipeline rank ``pp_rank`` at its fullest: the micro-batch chunks in flight (read
    from the schedule the executor runs), each with its own chunk's blocks, plus the recomputed block being
    rebuilt, plus the head's final hidden state and logits on the last rank. Under full recompute
    each chunk checkpoints its every ``recompute_every``-th block from its first (as
    ``apply_activation_checkpointing`` counts), which keeps its input alone. ``micro``: the step's
    micro-batches (default the full batch's)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    every = p.recompute_every if p.recompute == "full" else 0

    def kept(index: int, parts: tuple[str, ...]) -> float:  # what a chunk's block ``index`` keeps
        return layer_activation_bytes(cfg, every > 0 and index % every == 0, parts)

    per_chunk = [sum(kept(i, parts) for i, parts in enumerate(chunk)) for chunk in rank_chunks(cfg, pp_rank)]
    schedule, full = pipeline_schedule(cfg), micro_batches(cfg)
    # no other schedule reads the op costs, and the engine orders by them at the full batch alone
    costs = pipeline_costs(cfg) if schedule in SPLIT_BACKWARD and (micro or full) == full else None
    peaks = _live_peaks(schedule, p.pp, pp_rank, micro or full, p.virtual_stages, costs)
    total = weighted_peak(peaks, per_chunk)  # the chunks in flight at the peak, each its own bytes
    if every:
        total += layer_activation_bytes(cfg, recomputed=False)  # one block rebuilt at a time in backward
    if pp_rank == head_rank(cfg):
        e = DTYPE_BYTES[cfg.precision.dtype]
        tokens = m.seq_length * t.micro_batch_size
        total += 2 * e * tokens * m.hidden_size + e * tokens * padded_vocab_size(m.vocab_size, 128 * p.tp) / p.tp
    return total


def buffer_bytes(cfg: Config, pp_rank: int) -> float:
    """Communication buffers: ``bucket_bytes``, and under stage 3 reducing every backward the gathered
    16-bit parameters of the block in use and of those prefetched (reducing once per step every unit
    stays gathered, in the model states: ``gathered_until_step``)."""
    z = cfg.zero
    buffers = bucket_bytes(cfg, pp_rank)
    if z.stage == 3 and not reduces_once_per_step(cfg):
        buffers += (z.prefetch_depth + 1) * _block_on_rank(cfg) * DTYPE_BYTES[cfg.precision.dtype]
    return buffers


def bucket_bytes(cfg: Config, pp_rank: int) -> float:
    """Gradient scratch buffers: where gradients are reduce-scattered every backward (stages 2-3 without
    a pipeline or a split-backward schedule) each bucket is filled in a buffer of its own,
    ``SCRATCH_BUCKETS`` of them at most, each the size of the largest bucket (a unit's gradients
    where that is smaller than ``zero.bucket_size_mb``). Whole gradient buffers (stages 0-1, and 2-3 reducing once per step:
    ``reduces_once_per_step``) are reduced in place."""
    z = cfg.zero
    if z.stage < 2 or reduces_once_per_step(cfg):
        return 0.0
    grad_bytes = 4 if cfg.precision.accumulate_fp32 else DTYPE_BYTES[cfg.precision.dtype]
    largest_unit = max(_block_on_rank(cfg), rank_params(cfg, pp_rank) - rank_block_params(cfg, pp_rank))
    return SCRATCH_BUCKETS * min(z.bucket_size_mb * 2**20, largest_unit * grad_bytes)


def _block_on_rank(cfg: Config, parts: tuple[str, ...] = BLOCK_PARTS) -> float:
    """Parameters of one block (or the ``parts`` of it a stage holds) on a tensor rank."""
    split, replicated = block_params(cfg.model, parts)
    return split / cfg.parallel.tp + replicated


def estimate_memory(cfg: Config) -> MemoryEstimate:
    """The fullest pipeline rank, for a config whose layout (tp, pp, dp) is set. A split balanced by
    work gives middle ranks more blocks than the ends, and under the zero-bubble schedules every rank
    keeps pp micro-batches in flight, so a middle rank can hold the most. Without a split backward,
    among the middle ranks holding the same blocks and halves in each chunk the first is the fullest
    (no such schedule holds more micro-batches on a later rank), so the ends and the first middle rank
    of each such holding are the ones looked at; the zero-bubble schedules' delays, tuned rank by
    rank (``plan.weight_grad_delays``), can give a later rank more, so there every rank is. Under a
    batch ramp-up, each count of micro-batches that can hold more than the full batch's is looked at
    too (``fullest_counts``)."""
    pp, schedule = cfg.parallel.pp, pipeline_schedule(cfg)
    first_holding = {}
    for rank in range(1, pp - 1):
        first_holding.setdefault(tuple(map(tuple, rank_chunks(cfg, rank))), rank)
    ranks = range(pp) if schedule in SPLIT_BACKWARD else {0, pp - 1, *first_holding.values()}
    counts = fullest_counts(schedule, pp, cfg.parallel.virtual_stages, micro_batch_counts(cfg))
    estimates = []
    for rank in sorted(ranks):
        states, buffers = model_state_bytes(cfg, rank), buffer_bytes(cfg, rank)
        estimates += [MemoryEstimate(states, activation_bytes(cfg, rank, micro), buffers, rank,
                                     grads_outside_forward(cfg, rank, micro)) for micro in counts]
    return max(estimates, key=lambda e: e.peak)


def max_model_params(device_bytes: float, dp: int, stage: int, mp: int = 1) -> float:
    """Largest parameter count whose model states fit ``device_bytes`` per GPU with ``mp``-way model
    parallelism and ``dp``-way ZeRO (fp16 parameters and gradients, K = 12): the ZeRO paper's Table 2."""
    per_param = zero_model_state_bytes(1.0, dp, stage).total
    return mp * device_bytes / per_param
