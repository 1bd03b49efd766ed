"""Assembling one rank's share of a 3D-parallel GPT: its pipeline chunks, their tensor-parallel
form, the sharded optimizer over their parameters, and the pipeline executor that runs a step.

Everything here is composition; the parts live in ``models`` (the decoder, its plans and
``parallelize_gpt``), ``parallel`` (tensor, pipeline and data-parallel machinery) and
``megazero.optim`` (the sharded AdamW). ``Engine.train_step`` is one
optimizer step over a list of micro-batches, identical in meaning for every layout.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megazero.config import Config
from megazero.config.auto import resolve_auto
from megazero.errors import ConfigError
from megazero.flops import attention_core_share, attention_share, head_blocks
from megazero.optim import AdamWSettings, DynamicLossScaler, ShardedAdamW, StepResult
from megazero.random_state import restore_rng, rng_state
from models import GPT
from models.config import ModelConfig
from models.ops import IGNORE_INDEX
from models.parallelize import Parallelism, parallelize_gpt, recompute_replays_tp_stream
from parallel.data_parallel import DataParallelSettings
from parallel.pipeline import PipelineExecutor
from parallel.pipeline.partition import recomputed_work, resolve_split, stage_layers, stage_parts
from parallel.pipeline.placement import holder_of, placement_of, rank_stages
from parallel.pipeline.plan import StageCosts, stage_costs
from parallel.pipeline.schedule import SPLIT_BACKWARD, default_schedule
from parallel.tensor_parallel import peer_memory
from parallel.topology import Topology

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PIPELINE_SEED_OFFSET = 100
"""The default generator of pipeline rank r is seeded ``train.seed + 100 * r`` (``build_chunks``)."""


def data_parallel_settings(cfg: Config) -> DataParallelSettings:
    """The ZeRO wrapper's settings from the config (also what an offline layout needs)."""
    z, prec = cfg.zero, cfg.precision
    dtype = DTYPES[prec.dtype]
    grad_dtype = torch.float32 if prec.accumulate_fp32 else dtype  # buckets are sized in gradients
    return DataParallelSettings(
        stage=z.stage, bucket_numel=int(z.bucket_size_mb * 2**20) // torch.empty((), dtype=grad_dtype).element_size(),
        param_dtype=dtype, grad_dtype=grad_dtype, overlap_comm=z.overlap_comm,
        once_per_step=reduces_once_per_step(cfg), prefetch_depth=z.prefetch_depth,
        persistence_threshold=z.persistence_threshold, offload=z.offload_optimizer)


def reduces_once_per_step(cfg: Config) -> bool:
    """Whether ZeRO 2-3 keep whole gradients (stage 3 its gathered parameters too) for the step and
    reduce them once at its end, rather than after each unit's backward: under a pipeline, whose
    micro-batches' backwards interleave with other forwards, and under a split-backward schedule
    even without one, whose weight gradients come after the input gradients' pass had released
    the unit (stage 3 then read a parameter it no longer held)."""
    return cfg.zero.stage >= 2 and (cfg.parallel.pp > 1 or pipeline_schedule(cfg) in SPLIT_BACKWARD)


def _peer_memory_everywhere(cfg: Config, device: torch.device) -> bool:
    """Whether every rank's GPU maps its peers' memory (``peer_memory.reaches_peers``): agreed over the
    world, so every rank resolves ``parallel.tp_comm auto`` alike. Asked only where ``auto`` could
    choose peer memory (every rank holds the same config, so all ask or none do)."""
    p = cfg.parallel
    if device.type != "cuda" or p.tp_comm != "auto" or not p.sequence_parallel:
        return False
    reach = torch.tensor([1.0 if peer_memory.reaches_peers(device) else 0.0], device=device)
    dist.all_reduce(reach, op=dist.ReduceOp.MIN)
    return bool(reach.item())


RECOMPUTE_REPLAY_PROBLEM = ("parallel.recompute: recomputing tensor-parallel modules with dropout replays the "
                            "tensor-parallel random stream, which torch.compile cannot trace; set model.dropout and "
                            "model.attention_dropout to 0, parallel.recompute none, or train.compile false")
"""Refused where the blocks are built; the start-up checks ask the planner's model of the same rule."""


def parallelism(cfg: Config, device: torch.device, chunks: list[GPT]) -> Parallelism:
    """What ``parallelize_gpt`` needs from ``cfg`` (its auto settings resolved: ``resolve_auto``): the
    parallel, recompute, compile and ZeRO fields; refuses what this device cannot run on ``chunks``
    (still on the meta device)."""
    p = cfg.parallel
    compile_ = cfg.train.compile
    if p.tp_comm == "peer_memory" and not peer_memory.reaches_peers(device):
        raise ConfigError("parallel.tp_comm: peer_memory needs CUDA devices that map each other's memory and a "
                          "torch with symmetric memory; set it to serial or overlap")
    if cfg.train.cuda_graphs and not (compile_ and device.type == "cuda"):
        raise ConfigError("train.cuda_graphs: replays compiled blocks on GPUs; this run compiles nothing "
                          "or has no GPU, so set train.cuda_graphs false")
    if compile_ and p.tp > 1 and any(recompute_replays_tp_stream(c, p.recompute, p.recompute_every) for c in chunks):
        raise ConfigError(RECOMPUTE_REPLAY_PROBLEM)
    return Parallelism(seed=cfg.train.seed, sequence_parallel=p.sequence_parallel,
                       tp_comm=p.tp_comm, recompute=p.recompute,
                       recompute_every=p.recompute_every, compile=compile_, cuda_graphs=cfg.train.cuda_graphs,
                       split_backward=pipeline_schedule(cfg) in SPLIT_BACKWARD,
                       data_parallel=data_parallel_settings(cfg))


def pipeline_schedule(cfg: Config) -> str:
    """The schedule the executor runs (``auto`` resolved)."""
    p = cfg.parallel
    return default_schedule(p.pp, p.virtual_stages) if p.pipeline_schedule == "auto" else p.pipeline_schedule


def pipeline_placement(cfg: Config) -> str:
    """Which rank holds which virtual stage: ``v`` under zb-v, else ``loop`` (``parallel.pipeline.placement``)."""
    return placement_of(pipeline_schedule(cfg))


def head_rank(cfg: Config) -> int:
    """The pipeline rank holding the last virtual stage, with the head: the last rank, or the first
    in a V."""
    p = cfg.parallel
    return holder_of(p.pp, p.pp * p.virtual_stages - 1, pipeline_placement(cfg))[0]


def pipeline_stages(cfg: Config, pp_rank: int) -> list[int]:
    """The (virtual) pipeline stage of each chunk pipeline rank ``pp_rank`` runs."""
    p = cfg.parallel
    return rank_stages(p.pp, pp_rank, p.virtual_stages, pipeline_placement(cfg))


def pipeline_split(cfg: Config) -> list[float]:
    """Blocks per virtual stage, in virtual-stage order (a count may end in a half block):
    ``parallel.pipeline_split``, else balanced against the head's work on the last stage, in half
    blocks where that pays (``balanced_split``)."""
    m, p = cfg.model, cfg.parallel
    # a given split with its entries' types, so [12, 12] and [12.0, 12.0] each come back as given
    given = None if p.pipeline_split is None else tuple((type(k), k) for k in p.pipeline_split)
    return list(_split(tuple(vars(m).items()), p.pp, p.virtual_stages, given, pipeline_placement(cfg)))


@functools.lru_cache(maxsize=1024)
def _split(model_fields: tuple, pp: int, v: int, given: Optional[tuple], placement: str) -> tuple[float, ...]:
    """``pipeline_split`` by every field of the model (so a field the balance comes to read is never
    left out of the key) and the layout: the planner asks for each rank of thousands of layouts,
    and the balanced split costs a search over the blocks each time."""
    m = ModelConfig(**dict(model_fields))
    split = None if given is None else [k for _, k in given]
    return tuple(resolve_split(m.num_layers, pp, v, split, head_cost=head_blocks(m),
                               attention_share=attention_share(m), placement=placement))


def pipeline_costs(cfg: Config) -> Optional[StageCosts]:
    """Each pipeline rank's op costs of one micro-batch, estimated from its blocks and the head
    (``plan.stage_costs``), by which the zero-bubble schedules time their weight gradients; under zb-v
    one entry per virtual stage, by which it orders its ops. None for a pipeline of several chunks a
    rank in a loop (no schedule there uses them) or none at all."""
    m, p = cfg.model, cfg.parallel
    if p.pp == 1 or (p.virtual_stages != 1 and pipeline_placement(cfg) != "v"):
        return None
    return stage_costs(pipeline_split(cfg), head_blocks(m), attention_core_share(m), stage_recomputed_work(cfg))


def stage_recomputed_work(cfg: Config) -> list[float]:
    """Blocks' worth of forward work each virtual stage repeats in its backward: every block's
    attention core under selective recompute; under full, the blocks it checkpoints, every
    ``recompute_every``-th from its first (``partition.recomputed_work``)."""
    m, p, split = cfg.model, cfg.parallel, pipeline_split(cfg)
    if p.recompute == "full":
        return [recomputed_work(split, stage, p.recompute_every, attention_share(m)) for stage in range(len(split))]
    return [b * attention_core_share(m) if p.recompute == "selective" else 0.0 for b in split]


def layout_record(cfg: Config) -> dict:
    """What a checkpoint records of the layout that wrote it (a resolved config: ``parallel.dp`` set);
    a run whose own record differs reshards on load."""
    p = cfg.parallel
    record = {"tp": p.tp, "pp": p.pp, "dp": p.dp, "virtual_stages": p.virtual_stages, "order": p.order,
              "zero_stage": cfg.zero.stage, "world_size": p.tp * p.pp * p.dp, "pipeline_split": pipeline_split(cfg)}
    if pipeline_placement(cfg) != "loop":  # another rank holds each stage: a resume from a loop reshards
        record["placement"] = pipeline_placement(cfg)
    return record


def same_ranks(record: dict, cfg: Config) -> bool:
    """Whether a checkpoint's layout ``record`` puts every rank of this run at the tensor, pipeline and
    data coordinates (and chunks) it saved from: the record equal to this run's but for the ZeRO
    stage, which shards the optimizer's state differently and draws no random number. Such a rank's
    own file holds the random generators it would have now; elsewhere the generators start afresh
    (a resumed run with dropout then draws other masks than the uninterrupted one)."""
    mine = layout_record(cfg)
    return {**record, "zero_stage": None} == {**mine, "zero_stage": None}


def describe_layout(record: dict) -> str:
    """A checkpoint's layout record as a log line says it (``tp2 x pp2 x dp1, ZeRO-1, split [3, 1]``),
    naming the tool that wrote it where that was not a training run."""
    get = record.get
    parts = [f"tp{get('tp', '?')} x pp{get('pp', '?')} x dp{get('dp', '?')}", f"ZeRO-{get('zero_stage', '?')}"]
    if get("virtual_stages", 1) > 1:
        parts.append(f"{record['virtual_stages']} chunks a rank")
    if get("pp", 1) > 1:
        placed = f" placed {record['placement']}" if "placement" in record else ""
        parts.append(f"split {get('pipeline_split')}{placed}")
    if "written_by" in record:
        parts.append(f"written by {record['written_by']}")
    return ", ".join(parts)


def build_chunks(cfg: Config, pp_rank: int) -> list[GPT]:
    """Pipeline rank ``pp_rank``'s chunks on the meta device: ``parallelize_gpt`` materialises only this
    rank's shards (and an offline layout description reads their shapes alone).

    Seeds the default generator, from which dropout on replicated activations draws: identically on
    the tensor ranks of a stage, so their copies agree, but offset by the pipeline rank, as
    Megatron-LM does: with one seed everywhere each pipeline rank drew the very masks of the first
    (a later stage's blocks repeated the embedding's and the first blocks' dropout, mask for mask)."""
    m, p = cfg.model, cfg.parallel
    split, placement = pipeline_split(cfg), pipeline_placement(cfg)
    torch.manual_seed(cfg.train.seed + PIPELINE_SEED_OFFSET * pp_rank)
    chunks = []
    for c, stage in enumerate(pipeline_stages(cfg, pp_rank)):
        chunks.append(GPT(m, layers=stage_layers(split, p.pp, pp_rank, c, placement),
                          parts=stage_parts(split, p.pp, pp_rank, c, placement), has_embedding=stage == 0,
                          has_head=stage == p.pp * p.virtual_stages - 1, vocab_multiple=128 * p.tp,
                          seed=cfg.train.seed, device="meta"))
    return chunks


def adamw_settings(cfg: Config) -> AdamWSettings:
    o = cfg.optimizer
    return AdamWSettings(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                         clip_grad=o.clip_grad, fused=o.fused)


def loss_scaler(cfg: Config):
    """fp16 needs a dynamic loss scale; bf16 and fp32 train unscaled (None: a constant 1)."""
    prec = cfg.precision
    if prec.dtype != "fp16":
        return None
    return DynamicLossScaler(prec.initial_loss_scale, prec.loss_scale_window, prec.hysteresis, prec.min_loss_scale)


def gpt_forward_step(module, x, microbatch, first: bool, last: bool):
    """One chunk's forward for the executor: the last chunk returns the micro-batch's mean token loss."""
    tokens, labels = microbatch["tokens"], microbatch["labels"]
    inputs = tokens if first else x
    if not last:
        return module(inputs)
    return module(inputs, labels, reduction="sum") / (labels != IGNORE_INDEX).sum().clamp(min=1)


@dataclass
class StepOutput:
    """One step's loss and optimizer result; both stay on the device until read, so a caller that
    does not look (a benchmark) lets the next step queue up behind this one without a host sync."""
    loss_value: torch.Tensor
    result: StepResult

    @property
    def loss(self) -> float:
        return float(self.loss_value)


class Engine:
    """This rank's model chunks, optimizer and pipeline executor for ``cfg`` on ``topology``."""

    def __init__(self, cfg: Config, topology: Topology, device: torch.device):
        cfg = resolve_auto(cfg, device.type == "cuda", _peer_memory_everywhere(cfg, device))
        self.cfg, self.topo, self.device = cfg, topology, device
        p = cfg.parallel
        self.dtype = DTYPES[cfg.precision.dtype]
        self.stages = pipeline_stages(cfg, topology.pp_rank)
        self.chunks = build_chunks(cfg, topology.pp_rank)
        self.data_parallel = parallelize_gpt(self.chunks, self.stages, topology, parallelism(cfg, device, self.chunks),
                                             device, tied_here=pipeline_placement(cfg) == "v")
        if p.tp_comm == "peer_memory":  # validated: only with sequence parallelism, so tp > 1
            # The largest transfer is one micro-batch's tokens, gathered or summed, at the hidden width.
            tokens = cfg.train.micro_batch_size * cfg.model.seq_length
            # Its barriers fail by a device-side trap, which takes the CUDA context down with a
            # message of its own: at twice the collective timeout they stay behind NCCL's watchdog
            # and the trainer's deadline (5% past it), whose messages name the rank and the wait.
            peer_memory.reserve(topology.tp_group.group_name, tokens * cfg.model.hidden_size * self.dtype.itemsize,
                                barrier_timeout_s=2 * cfg.train.collective_timeout_s)
        if cfg.zero.offload_optimizer and device.type == "cuda":
            # The host AdamW is multi-threaded; launchers start ranks with one thread each.
            per_rank = (os.cpu_count() or 1) // max(1, topology.ranks_per_node or 1)
            torch.set_num_threads(max(1, per_rank))
        self.optimizer = ShardedAdamW(self.data_parallel, adamw_settings(cfg), topology.mp_group, loss_scaler(cfg))
        seq = cfg.model.seq_length // p.tp if p.sequence_parallel else cfg.model.seq_length
        self.executor = PipelineExecutor(
            self.chunks, topology, (cfg.train.micro_batch_size, seq, cfg.model.hidden_size),
            dtype=self.dtype, device=device, forward_step=gpt_forward_step,
            schedule=pipeline_schedule(cfg),
            timeout_s=cfg.train.collective_timeout_s, before_backward=self._before_backward,
            weight_grad_sink=self.data_parallel, op_costs=pipeline_costs(cfg),
            costs_at=cfg.train.global_batch_size // (cfg.train.micro_batch_size * topology.dp_size))

    def _new_graph_step(self) -> None:
        """Blocks replayed as CUDA graphs write their outputs into memory the next replay reuses:
        say that the last step's outputs are dead, rather than leave torch to infer it."""
        if self.cfg.train.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    def _before_backward(self, op, last: bool) -> None:
        """Without interleaving the step's last backward completes every gradient, so whole-gradient
        ZeRO stages (0 and 1) can reduce each bucket as soon as that backward finishes it."""
        if self.cfg.parallel.virtual_stages == 1:
            self.data_parallel.begin_microbatch(last)

    def _rehearse(self, microbatches: list[dict], keep_graph: bool) -> None:
        """The pipeline's rehearsal of a first step (``PipelineExecutor.rehearse``: it loads the step's
        kernels before any transfer), leaving no trace: the random streams are put back and its
        gradients dropped, so the real step is bit for bit what it would have been."""
        streams = rng_state(self.chunks)
        self.executor.rehearse(microbatches, keep_graph)
        restore_rng(self.chunks, streams)
        if keep_graph:
            self.optimizer.zero_grad()

    # --- training ----------------------------------------------------------------------------
    def train_step(self, microbatches: list[dict], lr: Optional[float] = None) -> StepOutput:
        """Forward and backward every micro-batch through the pipeline, then one optimizer step."""
        self._new_graph_step()
        microbatches = [{k: v.to(self.device, non_blocking=True) for k, v in mb.items()} for mb in microbatches]
        if self.executor.rehearsal_due(len(microbatches), keep_graph=True):
            self._rehearse(microbatches, keep_graph=True)
        loss = self.executor.step(microbatches, grad_scale=self.optimizer.scaler.scale)
        result = self.optimizer.step(lr, skip=~torch.isfinite(loss))  # the loss agrees on every rank
        return StepOutput(loss, result)

    @torch.no_grad()
    def eval_loss(self, microbatches: list[dict]) -> float:
        """Mean loss over ``microbatches`` without gradients (forward only, through the pipeline)."""
        for chunk in self.chunks:
            chunk.eval()
        try:
            self._new_graph_step()
            microbatches = [{k: v.to(self.device) for k, v in mb.items()} for mb in microbatches]
            if self.executor.rehearsal_due(len(microbatches), keep_graph=False):
                self._rehearse(microbatches, keep_graph=False)
            return float(self.executor.forward_only(microbatches))
        finally:
            for chunk in self.chunks:
                chunk.train()

