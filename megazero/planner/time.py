"""Step time of a layout: compute at the GPU's calibrated rate, the communication it cannot hide,
the host's launch work where it outlasts both, the pipeline bubble, and the optimizer step. Every
term is written out in docs/planner.md."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from megazero.config.auto import resolve_auto
from megazero.config.schema import Config
from megazero.engine import head_rank, pipeline_costs, pipeline_schedule, reduces_once_per_step
from megazero.flops import flops_per_token
from megazero.planner.hardware import Cluster
from megazero.planner.memory import (DTYPE_BYTES, micro_batches, persistent_params, rank_params, rank_recomputed_work,
                                     rank_work)
from parallel.pipeline.plan import StageCosts, modelled_step, v_orders_span, weight_grad_delays
from parallel.pipeline.placement import V_SHAPED, placement_of, sends_per_microbatch
from parallel.pipeline.schedule import SPLIT_BACKWARD, bubble_fraction
from parallel.pipeline.v_order import modelled_span
from parallel.topology import RankGrid

# The optimizer step streams each shard element's gradient, fp32 master and two moments through
# device memory and writes the 16-bit parameter back; like the links, HBM delivers about 80% of its
# datasheet bandwidth to such streaming kernels.
HBM_EFFICIENCY = 0.8
ADAM_BYTES_PER_ELEMENT = 8 + 16  # master read + write, two moments read + write (fp32)

# The host's work per block and micro-batch on a tensor-parallel rank when each kernel and collective
# is launched one by one: about the same at any width, so it bounds the step once the GEMMs, which
# tensor parallelism shrinks, take less. Measured on the 1.3B GPT with tp 2 and sequence parallelism
# at micro-batch 4, where the host set the pace (BENCHMARKS.md): 154 ms per micro-batch on 2 x H100
# and 141.6 ms per one-micro-batch step on 2 x H200, for 24 blocks. Blocks replayed as CUDA graphs
# (train.cuda_graphs) launch once per block and are not bound by it.
HOST_S_PER_TP_BLOCK = 6.0e-3
# The same under a split-backward (zero-bubble) schedule, whose linears deferred their weight gradients
# from outside the compiled graphs (``parallel.pipeline.deferred_wgrad``): a compiled block ran as the
# pieces between its linears, each called and guarded on its own, and the weight gradients came back
# as ops of their own. GPT 1.3B at tp 2 x pp 2 with 8 micro-batches of 8 on
# 4 x H200: ZB-H2 took 966 ms a step for the 13 blocks of its first rank, against 721 ms for 1F1B,
# with the GPUs computing a third of the time (BENCHMARKS.md): 9.3 ms a block and micro-batch.
# Measured before the linears deferred from inside the compiled graph; to be measured again.
HOST_S_PER_TP_BLOCK_SPLIT_BACKWARD = 9.3e-3
# The share of the tensor-parallel term above that stays exposed when the sequence-parallel linears
# move their tokens through peer memory (``parallel.tp_comm peer_memory``): the copy engines carry the
# bytes, so the products beside them keep more of the multiprocessors than beside NCCL's kernels.
# Fitted to GPT 1.3B at tp 2 + sp in CUDA-graph blocks on 2 x H200 (BENCHMARKS.md, "Auto settings"):
# 149.9 ms a step at micro-batch 8 and 81.9 ms at 4, where the NCCL term would add 31.8 and 15.9 ms
# to 129.6 and 64.8 ms of compute; with 0.7 the planner gives 157.0 and 81.1 ms.
PEER_MEMORY_EXPOSED_SHARE = 0.7
# What running a backward as its input-gradient and weight-gradient halves adds to a micro-batch's
# compute (zero-bubble schedules): the weights' gradient GEMMs and the biases' sums no longer fuse
# with the rest of the backward. GPT 1.3B at pp 2 on H200, rank 0: B + W 89.1 ms against a whole
# backward of 86.0 ms, over a forward and backward of 126 ms (BENCHMARKS.md).
SPLIT_BACKWARD_COST = 0.025
# Most ops (ranks times three a micro-batch) for which a zero-bubble schedule's idle time is timed
# with the stages' op costs (``_split_backward_idle``) rather than taken from equal costs.
_TIMED_SCHEDULE_OPS = 5_000


@dataclass(frozen=True)
class StepEstimate:
    step_s: float
    compute_s: float        # the slowest pipeline rank's own forward/backward work, communication aside
    tp_comm_s: float
    host_s: float           # the host's work per step where it, not the GPU, sets the pace (else 0)
    pp_comm_s: float
    bubble_s: float
    dp_comm_s: float        # the part of the data-parallel traffic that compute does not hide
    optimizer_s: float
    tokens_per_s: float
    tflops_per_gpu: float   # hardware FLOPs (recomputation included), as Megatron and MT-NLG report
    mfu: float              # model FLOPs (no recomputation) over the dense peak


def _group_within_node(cfg: Config, kind: str, cluster: Cluster) -> bool:
    """Whether every group of ``kind`` ("tp", "dp", "pp") sits in one node, so that it talks over NVLink."""
    p = cfg.parallel
    return _grid_within_nodes(kind, p.tp, p.pp, p.dp, p.order, cluster.gpus_per_node)


@functools.lru_cache(maxsize=4096)
def _grid_within_nodes(kind: str, tp: int, pp: int, dp: int, order: str, gpus_per_node: int) -> bool:
    """``RankGrid.within_nodes`` from the groups themselves: a group's stride times its size within a
    node's width said nothing of where it starts (24 GPUs at 8 a node, tp 2 pp 4 dp 3: the dp group of
    ranks 6, 8 and 10 spans two nodes). Cached: a plan asks it of many layouts of each grid."""
    return RankGrid(tp=tp, pp=pp, dp=dp, order=order).within_nodes(kind, gpus_per_node)


def estimate_step(cfg: Config, cluster: Cluster) -> StepEstimate:
    cfg = resolve_auto(cfg, on_cuda=True, peer_memory=True)  # the cluster's GPUs, as the engine would there
    m, p, t, z = cfg.model, cfg.parallel, cfg.train, cfg.zero
    gpu = cluster.gpu
    micro = micro_batches(cfg)
    tokens_mb = m.seq_length * t.micro_batch_size
    e = DTYPE_BYTES[cfg.precision.dtype]
    head, model_flops = 6 * m.hidden_size * m.vocab_size, flops_per_token(m)
    per_layer = (model_flops - head) / m.num_layers  # a block's forward and backward
    block_forward = per_layer / 3
    # repeated forwards, per rank: the attention core of every block (selective), or every k-th block
    # of each chunk (full), whose collectives repeat too
    selective = flops_per_token(m, "selective") - model_flops if p.recompute == "selective" else 0.0
    recomputed = [rank_recomputed_work(cfg, rank) for rank in range(p.pp)]
    hardware = model_flops + sum(recomputed) * block_forward + selective

    # Tensor parallelism: per block, two all-reduces (or all-gather + reduce-scatter pairs under
    # sequence parallelism, the same bytes) forward, two backward, two more in a recomputed forward.
    tp_allreduce = 0.0  # one of them, for a micro-batch's activations
    if p.tp > 1:
        bw = cluster.link_bytes_per_s(_group_within_node(cfg, "tp", cluster), tensor_parallel=True)
        tp_allreduce = 2 * (p.tp - 1) / p.tp * e * tokens_mb * m.hidden_size / bw
        if p.tp_comm == "peer_memory":
            tp_allreduce *= PEER_MEMORY_EXPOSED_SHARE

    # Pipeline parallelism: per micro-batch, each activation a rank hands to another rank's stage and
    # each gradient it hands back (``sends_per_microbatch``: the V's turn stays on its rank).
    schedule = pipeline_schedule(cfg)
    send_s = 0.0
    if p.pp > 1:
        bw = cluster.link_bytes_per_s(_group_within_node(cfg, "pp", cluster))
        send_s = e * tokens_mb * m.hidden_size / (p.tp if p.sequence_parallel else 1) / bw

    slowest = (0.0, 0.0, 0.0, 0)
    for rank in range(p.pp):
        work = rank_work(cfg, rank)
        repeated = recomputed[rank] * block_forward + work / m.num_layers * selective
        flops = tokens_mb * (work * per_layer + repeated + (head if rank == head_rank(cfg) else 0.0)) / p.tp
        compute = flops / gpu.flops + _micro_batch_fixed_s(cfg, gpu, rank, work + recomputed[rank] / 3)
        tp_comm = (4 * work + 2 * recomputed[rank]) * tp_allreduce
        pp_comm = send_s * sends_per_microbatch(p.pp, rank, p.virtual_stages, placement_of(schedule))
        if compute + tp_comm + pp_comm > sum(slowest[:3]):
            slowest = (compute, tp_comm, pp_comm, rank)
    compute_mb, tp_mb, pp_per_mb, rank = slowest
    if schedule in SPLIT_BACKWARD:  # input and weight gradients computed apart cost more
        compute_mb *= 1 + SPLIT_BACKWARD_COST
    host_launches = 0.0
    if p.tp > 1 and not t.cuda_graphs:
        per_block = HOST_S_PER_TP_BLOCK_SPLIT_BACKWARD if schedule in SPLIT_BACKWARD else HOST_S_PER_TP_BLOCK
        host_launches = max(rank_work(cfg, r) for r in range(p.pp)) * per_block
    host_mb = max(0.0, host_launches - compute_mb - tp_mb)  # what the host adds beyond the GPU's own time
    stage_mb = compute_mb + tp_mb + host_mb + pp_per_mb
    idle = _split_backward_idle(cfg, schedule, micro)
    if idle is None:
        idle = bubble_fraction(p.pp, micro, p.virtual_stages, schedule)
    bubble = idle * micro * stage_mb

    dp_exposed = _data_parallel_exposed(cfg, cluster, rank, compute_mb, micro)
    shard = rank_params(cfg, rank) / (p.dp if z.stage >= 1 else 1)
    grad_bytes = 4 if cfg.precision.accumulate_fp32 else e
    optimizer = shard * (ADAM_BYTES_PER_ELEMENT + grad_bytes + e) / (gpu.hbm_GBps * 1e9 * HBM_EFFICIENCY)

    step = micro * stage_mb + bubble + dp_exposed + optimizer
    tokens = t.global_batch_size * m.seq_length
    return StepEstimate(
        step_s=step, compute_s=micro * compute_mb, tp_comm_s=micro * tp_mb, host_s=micro * host_mb,
        pp_comm_s=micro * pp_per_mb,
        bubble_s=bubble, dp_comm_s=dp_exposed, optimizer_s=optimizer, tokens_per_s=tokens / step,
        tflops_per_gpu=hardware * tokens / step / cluster.num_gpus / 1e12,
        mfu=flops_per_token(m) * tokens / step / cluster.num_gpus / (gpu.peak_tflops * 1e12))


def _micro_batch_fixed_s(cfg: Config, gpu, rank: int, blocks: float) -> float:
    """What a micro-batch costs pipeline rank ``rank`` whatever its token count, on a GPU where that was
    measured (``GPU.block_overhead_s``): every 16-bit weight read by the forward and again by the
    input-gradient products, every gradient read and written by the weight-gradient products that
    accumulate into it, and the start and drain of the kernels of ``blocks`` blocks' forward and
    backward (a recomputed forward counts a third of one). It is why small micro-batches run slower
    (GPT 1.3B on one H200: 0.77 of micro-batch 8's tokens/s at micro-batch 1)."""
    if gpu.block_overhead_s is None:
        return 0.0
    e = DTYPE_BYTES[cfg.precision.dtype]
    grad_bytes = 4 if cfg.precision.accumulate_fp32 else e
    traffic = rank_params(cfg, rank) * (2 * e + 2 * grad_bytes)
    return traffic / (gpu.hbm_GBps * 1e9 * HBM_EFFICIENCY) + blocks * gpu.block_overhead_s


def _split_backward_idle(cfg: Config, schedule: str, micro: int) -> Optional[float]:
    """The busiest rank's idle time over its busy time under ZB-H1 or ZB-H2, from the schedule timed
    with each rank's op costs (forward, input gradient, weight gradient: ``engine.pipeline_costs``) at
    the weight-gradient delays the executor will pick; under ZB-V from the list scheduler's own model
    of the order it picks with each stage's costs (messages free); None where equal costs stand in
    (other schedules, interleaving, or pipelines too long to time here).

    Why not the equal-cost figure: the three halves are not equal (GPT 1.3B, 1 : 1.29 : 0.83 measured).
    ZB-H1 idles (pp - 1)(F + B - W), more than the third of 1F1B's that equal costs give, while ZB-H2
    idles about a rank's first forward, and its extra warm-up forwards absorb what the head's heavy
    forward leaves the last rank short. At GPT 1.3B, pp 2, 8 micro-batches this gives 6.0% and 1.9%
    against 4.2% for both, and H200s ran ZB-H2 3.1% faster than ZB-H1 (BENCHMARKS.md, 2026-11-28)."""
    p = cfg.parallel
    if schedule in V_SHAPED and 6 * p.pp * micro <= _TIMED_SCHEDULE_OPS:
        span, busy = modelled_span(p.pp, micro, pipeline_costs(cfg).ops, runs=v_orders_span)
        return span / max(busy) - 1
    if (schedule not in SPLIT_BACKWARD or p.pp == 1 or p.virtual_stages != 1
            or 3 * p.pp * micro > _TIMED_SCHEDULE_OPS):
        return None
    return _timed_idle(schedule, p.pp, micro, pipeline_costs(cfg))


@functools.lru_cache(maxsize=1024)
def _timed_idle(schedule: str, pp: int, micro: int, costs: StageCosts) -> float:
    """``_split_backward_idle`` for one schedule and op costs: many candidate layouts of a plan share
    them, and each timing simulates every op of the step, several times for the delays."""
    span = modelled_step(schedule, pp, micro, costs, weight_grad_delays(schedule, pp, micro, costs))
    return span / max(micro * sum(ops) for ops in costs.ops) - 1


def _data_parallel_exposed(cfg: Config, cluster: Cluster, rank: int, compute_mb: float, micro: int) -> float:
    """Seconds of ZeRO traffic left after overlap with compute on pipeline rank ``rank``. Stages 0-1
    (and 2-3 reducing once per step: ``reduces_once_per_step``) reduce gradients during the last
    micro-batch's backward,
    where ``zero.overlap_comm`` lets them (otherwise after it, all exposed); interleaving reduces after
    the last backward, with nothing left to hide behind. The rest overlaps whatever that option says,
    as the wrapper does: stages 1-2 gather the updated parameters during the next forward; stage 2
    otherwise reduce-scatters every micro-batch's gradients during its backward. Stage 3 gathers its
    persistent unit as the forward starts, with nothing to hide behind, once per step; reducing once
    per step its blocks once per step too, during the first forward; otherwise each block for every
    forward and backward, prefetched behind the compute."""
    p, z, prec = cfg.parallel, cfg.zero, cfg.precision
    d = p.dp
    if d == 1:
        return 0.0
    bw = cluster.link_bytes_per_s(_group_within_node(cfg, "dp", cluster))
    e = DTYPE_BYTES[prec.dtype]
    g = 4 if prec.accumulate_fp32 else e
    numel = rank_params(cfg, rank)
    reduce_scatter = (d - 1) / d * numel * g / bw
    gather = (d - 1) / d * numel * e / bw
    backward, forward = 2 / 3 * compute_mb, 1 / 3 * compute_mb
    last_backward = backward if z.overlap_comm and p.virtual_stages == 1 else 0.0  # the whole-gradient reductions
    once_per_step = z.stage < 2 or reduces_once_per_step(cfg)
    if z.stage == 0:
        return max(0.0, 2 * reduce_scatter - last_backward)
    exposed = 0.0
    if z.stage == 3:
        persistent = gather * persistent_params(cfg, rank) / numel
        exposed, gather = persistent, gather - persistent
        if not once_per_step:
            return exposed + micro * max(0.0, 2 * gather + reduce_scatter - compute_mb)
    if once_per_step:
        reduce = max(0.0, reduce_scatter - last_backward)
    else:
        reduce = micro * max(0.0, reduce_scatter - backward)
    return exposed + reduce + max(0.0, gather - forward)
