"""Assembling one rank's share of a 3D-parallel GPT: its pipeline chunks, their tensor-parallel
form, the ZeRO optimizer over their parameters, and the pipeline executor that runs a step.

Everything here is composition; the parts live in ``models`` (the decoder and its plans),
``parallel`` (tensor and pipeline machinery) and ``megazero.zero``. ``Engine.train_step`` is one
optimizer step over a list of micro-batches, identical in meaning for every layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from megazero.config import Config
from megazero.zero import DynamicLossScaler, StepResult, ZeroOptimizer, ZeroSettings
from models import GPT
from models.ops import IGNORE_INDEX
from models.parallelize import parallelize_gpt
from parallel.pipeline import PipelineExecutor
from parallel.pipeline.partition import resolve_split, stage_layers
from parallel.tensor_parallel.sharding import param_shards
from parallel.topology import Topology

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def gpt_forward_step(module, x, microbatch, first: bool, last: bool):
    """One chunk's forward for the executor: the last chunk returns the micro-batch's mean token loss."""
    tokens, labels = microbatch["tokens"], microbatch["labels"]
    out = module(tokens if first else x, labels if last else None)
    if not last:
        return out
    return out.sum() / (labels != IGNORE_INDEX).sum().clamp(min=1)


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
        self.cfg, self.topo, self.device = cfg, topology, device
        p = cfg.parallel
        self.dtype = DTYPES[cfg.precision.dtype]
        self.chunks = self._build_chunks()
        self.optimizer = self._build_optimizer()
        seq = cfg.model.seq_length // p.tp if p.sequence_parallel else cfg.model.seq_length
        self.executor = PipelineExecutor(
            self.chunks, topology, (cfg.train.micro_batch_size, seq, cfg.model.hidden_size),
            dtype=self.dtype, device=device, forward_step=gpt_forward_step,
            timeout_s=cfg.train.collective_timeout_s, before_backward=self._before_backward)

    def _before_backward(self, op, last: bool) -> None:
        """Without interleaving the step's last backward completes every gradient, so whole-gradient
        ZeRO stages (0 and 1) can reduce each bucket as soon as that backward finishes it."""
        if self.cfg.parallel.virtual_stages == 1:
            self.optimizer.begin_microbatch(last)

    # --- construction ------------------------------------------------------------------------
    @property
    def split(self) -> list[int]:
        """Blocks per virtual stage, in virtual-stage order: ``parallel.pipeline_split``, else equal."""
        m, p = self.cfg.model, self.cfg.parallel
        return resolve_split(m.num_layers, p.pp, p.virtual_stages, p.pipeline_split)

    def _build_chunks(self) -> list[GPT]:
        """Each chunk is built on the meta device and only this rank's shard is materialised, with
        values that do not depend on the layout (see ``models.init``)."""
        cfg, topo, p = self.cfg, self.topo, self.cfg.parallel
        split = self.split
        chunks = []
        seed = cfg.train.seed
        for c in range(p.virtual_stages):
            stage = c * p.pp + topo.pp_rank
            torch.manual_seed(seed)  # identical on tensor ranks: replicated dropout agrees
            chunk = GPT(cfg.model, layers=stage_layers(split, p.pp, topo.pp_rank, c), has_embedding=stage == 0,
                        has_head=stage == p.pp * p.virtual_stages - 1, vocab_multiple=128 * p.tp, seed=seed,
                        device="meta")
            # The tensor-parallel dropout stream differs per stage, so stages draw different masks.
            parallelize_gpt(chunk, topo.tp_group, seed=seed + 1000 * stage, device=self.device,
                            sequence_parallel=p.sequence_parallel, recompute=p.recompute,
                            recompute_every=p.recompute_every)
            chunk.to_empty(device=self.device)
            chunk.init_weights(seed)
            chunk.train()
            if cfg.train.compile or (cfg.train.compile is None and self.device.type == "cuda"):
                self._compile(chunk)
            chunks.append(chunk)
        return chunks

    def _compile(self, chunk: GPT) -> None:
        """Compile each block's forward, and the head with its loss where it is plain torch (tp 1):
        forwards only, so module hooks (ZeRO stage 3 gathers) stay eager; a tensor-parallel head
        keeps its collectives outside any graph."""
        for block in chunk.layers.values():
            block.forward = torch.compile(block.forward)
        if chunk.lm_head is not None and self.cfg.parallel.tp == 1:
            chunk.head = torch.compile(chunk.head)

    def _build_optimizer(self) -> ZeroOptimizer:
        cfg, topo = self.cfg, self.topo
        z, o, prec = cfg.zero, cfg.optimizer, cfg.precision
        scaler = None
        if prec.dtype == "fp16":
            scaler = DynamicLossScaler(prec.initial_loss_scale, prec.loss_scale_window, prec.hysteresis,
                                       prec.min_loss_scale)
        grad_dtype = torch.float32 if prec.accumulate_fp32 else self.dtype  # buckets are sized in gradients
        settings = ZeroSettings(
            stage=z.stage, bucket_numel=int(z.bucket_size_mb * 2**20) // torch.empty((), dtype=grad_dtype).element_size(),
            param_dtype=self.dtype, grad_dtype=grad_dtype,
            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, clip_grad=o.clip_grad,
            overlap_comm=z.overlap_comm, once_per_step=cfg.parallel.pp > 1 and z.stage >= 2,
            prefetch_depth=z.prefetch_depth, persistence_threshold=z.persistence_threshold,
            offload=z.offload_optimizer, fused=o.fused, loss_scaler=scaler)
        if z.offload_optimizer and self.device.type == "cuda":
            # The CPU AdamW is multi-threaded; launchers start ranks with one thread each.
            per_rank = (os.cpu_count() or 1) // max(1, self.topo.ranks_per_node or 1)
            torch.set_num_threads(max(1, per_rank))
        container = torch.nn.ModuleList(self.chunks)
        units = [block for chunk in self.chunks for block in chunk.layers.values()]
        return ZeroOptimizer(container, settings, topo.dp_group, topo.mp_group, units=units,
                             counts_for_norm=self._counts_for_norm(container), roots=self.chunks,
                             tied=self._tied_params())

    def _counts_for_norm(self, container: torch.nn.Module):
        """Sharded parameters count on every tensor rank, replicated ones on the first only; a
        tied head on a stage without the embedding is the embedding's second copy."""
        sharded = {id(container.get_parameter(name)) for name in param_shards(container)}
        first_tp = self.topo.tp_rank == 0
        second_copies = {id(c.tied_head_copy) for c in self.chunks if c.tied_head_copy is not None}

        def counts(name: str, param: torch.nn.Parameter) -> bool:
            if id(param) in second_copies:
                return False
            return id(param) in sharded or first_tp
        return counts

    def _tied_params(self) -> list[tuple[torch.nn.Parameter, object]]:
        """The embedding and its tied head copy when they sit on different pipeline stages."""
        if not self.cfg.model.tie_embeddings or self.cfg.parallel.pp == 1:
            return []
        group = self.topo.embedding_group
        tied = []
        for chunk in self.chunks:
            if chunk.embedding is not None:
                tied.append((chunk.embedding.tokens.weight, group))
            if chunk.tied_head_copy is not None:
                tied.append((chunk.tied_head_copy, group))
        return tied

    # --- training ----------------------------------------------------------------------------
    def train_step(self, microbatches: list[dict], lr: Optional[float] = None) -> StepOutput:
        """Forward and backward every micro-batch through the pipeline, then one optimizer step."""
        microbatches = [{k: v.to(self.device, non_blocking=True) for k, v in mb.items()} for mb in microbatches]
        loss = self.executor.step(microbatches, grad_scale=self.optimizer.scaler.scale)
        result = self.optimizer.step(lr, skip=~torch.isfinite(loss))  # the loss agrees on every rank
        return StepOutput(loss, result)

    @torch.no_grad()
    def eval_loss(self, microbatches: list[dict]) -> float:
        """Mean loss over ``microbatches`` without gradients (forward only, through the pipeline)."""
        for chunk in self.chunks:
            chunk.eval()
        try:
            microbatches = [{k: v.to(self.device) for k, v in mb.items()} for mb in microbatches]
            return float(self.executor.forward_only(microbatches))
        finally:
            for chunk in self.chunks:
                chunk.train()

