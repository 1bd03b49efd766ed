"""The one place that turns a rank's plain GPT chunks into its part of the 3D-parallel model.

``parallelize_gpt`` applies, in this order: tensor (and sequence) parallelism, activation
checkpointing, materialisation of this rank's shards, ``torch.compile``, and data parallelism
(ZeRO), as torchtitan's ``parallelize_llama`` does. The model says *what* splits (``TP_PLAN``), *what*
to recompute (``RECOMPUTE_TARGETS``), which parameters are tied and what each parameter's logical
name is; ``parallel`` knows *how*. This file joins the two and checks that the model's widths divide
by tp, naming the config field that does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from models.config import ModelConfig
from models.gpt import GPT, RECOMPUTE_TARGETS, TP_PLAN
from parallel import comm
from parallel.data_parallel import DataParallel, DataParallelSettings, ParamInfo
from parallel.tensor_parallel.apply import apply_activation_checkpointing, apply_tensor_parallel, tp_stream_replays
from parallel.tensor_parallel.partial_grads import partial_grad_names
from parallel.tensor_parallel.random import TensorParallelRNG
from parallel.tensor_parallel.sharding import param_shards
from parallel.topology import Topology

RECOMPUTE_MODES = ("none", "full", "selective")


def tp_layout_problems(cfg: ModelConfig, tp: int) -> list[str]:
    """The widths ``TP_PLAN`` splits over ``tp`` ranks and do not divide: attention heads (query and,
    when they differ, key/value) and the MLP's inner width. Config validation reports these before
    launch; ``check_tp_layout`` refuses a model built without it."""
    split = [("model.num_heads", cfg.num_heads), ("model.ffn_hidden_size", cfg.ffn_size)]
    if cfg.kv_heads != cfg.num_heads:
        split.append(("model.num_kv_heads", cfg.kv_heads))
    return [f"{name}: {value} is not divisible by parallel.tp {tp}; change one of them"
            for name, value in split if value % tp]


def check_tp_layout(model: GPT, tp: int) -> None:
    problems = tp_layout_problems(model.cfg, tp)
    if problems:
        raise ValueError("; ".join(problems))
    if model.padded_vocab % tp:
        raise ValueError(f"padded vocabulary {model.padded_vocab} is not divisible by tp {tp}: "
                         f"build the model with vocab_multiple=128*tp")


@dataclass
class Parallelism:
    """How ``parallelize_gpt`` treats a rank's chunks (the engine fills it from the config)."""

    seed: int  # initial weights; the tp dropout stream of chunk c uses seed + 1000 * its pipeline stage
    sequence_parallel: bool = False
    tp_comm: str = "overlap"  # how sequence-parallel linears communicate: one of tensor_parallel.overlap.MODES
    recompute: str = "none"  # one of RECOMPUTE_MODES
    recompute_every: int = 1
    compile: bool = False
    cuda_graphs: bool = False  # compiled blocks replay as CUDA graphs (reduce-overhead)
    # a split-backward pipeline schedule will defer the weight gradients (``parallel.pipeline.deferred_wgrad``)
    split_backward: bool = False
    data_parallel: DataParallelSettings = field(default_factory=DataParallelSettings)


def parallelize_gpt(chunks: list[GPT], stages: list[int], topo: Topology, plan: Parallelism,
                    device: torch.device, tied_here: bool = False) -> DataParallel:
    """Make ``chunks`` (built on the meta device; chunk c is pipeline stage ``stages[c]``) this rank's
    tensor-parallel, checkpointed, materialised and compiled chunks, and return the data-parallel
    wrapper over all of them. ``tied_here``: the first and last stages sit on one rank (a V-shaped
    pipeline), so a tied embedding's two copies are summed on that rank, with no embedding group."""
    for chunk, stage in zip(chunks, stages):
        # The tensor-parallel dropout stream differs per stage, so stages draw different masks.
        tensor_parallelize_gpt(chunk, topo.tp_group, seed=plan.seed + 1000 * stage, device=device,
                               sequence_parallel=plan.sequence_parallel, tp_comm=plan.tp_comm,
                               recompute=plan.recompute,
                               recompute_every=plan.recompute_every)
        # Only this rank's shards are materialised, with values that do not depend on the layout.
        chunk.to_empty(device=device)
        chunk.init_weights(plan.seed)
        chunk.train()
        if plan.compile:
            tp = comm.group_size(topo.tp_group)
            compile_gpt(chunk, tp, cuda_graphs=plan.cuda_graphs, keep_handed_over=plan.split_backward)
    units = [block for chunk in chunks for block in chunk.layers.values()]
    tied_group = topo.embedding_group if topo.pp_size > 1 and not tied_here else None
    return DataParallel(chunks, plan.data_parallel, topo.dp_group, units=units,
                        info=describe_params(chunks, topo.tp_rank, tied=topo.pp_size > 1,
                                             split_backward=plan.split_backward),
                        tied_group=tied_group, tp_group=topo.tp_group)


def compile_options(cuda_graphs: bool, keep_handed_over: bool) -> dict:
    """``torch.compile``'s arguments for a block or the head (see ``compile_gpt``)."""
    if cuda_graphs:  # recorded per shape, and a run's shapes are fixed: compile for those exact shapes
        return {"mode": "reduce-overhead", "dynamic": False}
    if keep_handed_over:  # no buffer takes over the memory of another
        return {"options": {"allow_buffer_reuse": False, "inplace_buffers": False}}
    return {}


def compile_gpt(chunk: GPT, tp: int, cuda_graphs: bool = False, keep_handed_over: bool = False) -> None:
    """Compile each block's forward, and the embedding and the head with its loss where they are plain
    torch (tp 1): forwards only, so module hooks (ZeRO stage 3 gathers) stay eager; tensor-parallel
    ones keep their collectives outside any graph. (Compiled, the embedding's backward is inductor's
    scatter-add rather than aten's sort-based kernels: 0.22 against 0.56 ms a step at 125M on an
    H200.) ``cuda_graphs``: each block's compiled forward and backward replay as CUDA graphs, a
    launch per graph instead of one per kernel and collective. ``keep_handed_over``: the linears hand
    tensors of the backward to a split-backward schedule's queue, which reads them at a later ``W``
    op; inductor would reuse their memory once the graph no longer needs them, so blocks and head
    compile with buffer reuse off (a kept output gradient came back overwritten on CPU otherwise)."""
    options = compile_options(cuda_graphs, keep_handed_over)
    for block in chunk.layers.values():
        block.forward = torch.compile(block.forward, **options)
    if chunk.embedding is not None and tp == 1:
        chunk.embedding.forward = torch.compile(chunk.embedding.forward)
    if chunk.lm_head is not None and tp == 1:
        chunk.head = torch.compile(chunk.head, **compile_options(False, keep_handed_over))


def describe_params(chunks: list[GPT], tp_rank: int, tied: bool,
                    split_backward: bool = False) -> Callable[[torch.nn.Parameter], ParamInfo]:
    """Each parameter's logical name and tensor-parallel slice; whether it enters the gradient norm
    (sharded ones on every tensor rank, replicated ones on the first only, a tied head copy never:
    it is the embedding's second copy); which are summed over the tensor group (sequence-parallel
    norms and biases); when ``tied`` (the embedding and its head copy sit on different pipeline
    stages), which two are summed over the embedding group; and under a ``split_backward`` schedule,
    an embedding that is its own head (both on this stage) as complete only at the step's end: the
    lookup's share comes in the backward, the head's in the deferred weight pass after it, and its
    bucket, reduced when the first arrived, dropped the second (tp 2, ZB-H1, pp 1, dp 2: gradient
    norms 8% off)."""
    info = {}
    for chunk in chunks:
        shards = param_shards(chunk)
        partial = partial_grad_names(chunk)
        copy = chunk.tied_head_copy
        for name, param in chunk.named_parameters():
            is_copy = param is copy
            pair = tied and chunk.tied and (is_copy or (chunk.embedding is not None
                                                        and param is chunk.embedding.tokens.weight))
            shared = (chunk.tied and chunk.lm_head is not None and chunk.embedding is not None
                      and param is chunk.embedding.tokens.weight)
            info[id(param)] = ParamInfo(chunk.logical_name(name), shards.get(name),
                                        counts_for_norm=not is_copy and (name in shards or tp_rank == 0), tied=pair,
                                        tp_partial=name in partial, late=split_backward and shared)
    return lambda param: info[id(param)]


def _recompute_every(recompute: str, every: int) -> int:
    """Whole blocks may be recomputed one in ``every``; the attention core always is."""
    return every if recompute == "full" else 1


def recompute_replays_tp_stream(model: GPT, recompute: str, recompute_every: int = 1) -> list[str]:
    """The modules of ``model`` whose recompute under tensor parallelism would replay the tp random
    stream (they draw dropout from it): what torch.compile cannot trace, so what a compiled
    tensor-parallel run must not recompute."""
    if recompute == "none":
        return []
    return tp_stream_replays(model, RECOMPUTE_TARGETS[recompute], _recompute_every(recompute, recompute_every))


def tensor_parallelize_gpt(model: GPT, tp_group, *, seed: int, device="cpu", sequence_parallel: bool = False,
                           tp_comm: str = "overlap", recompute: str = "none", recompute_every: int = 1) -> GPT:
    """Apply tensor (and sequence) parallelism and activation checkpointing to ``model`` in place.

    ``seed`` seeds the tp dropout stream (offset by the tp rank); the caller seeds the default
    generator identically on all tp ranks. With a meta-device model, call ``to_empty`` and
    ``init_weights(seed)`` afterwards: each rank then materialises and draws only its shards.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute {recompute!r}: use one of {RECOMPUTE_MODES}")
    tp = comm.group_size(tp_group)
    check_tp_layout(model, tp)
    every = _recompute_every(recompute, recompute_every)
    if tp == 1:
        # The plain model is the one-rank layout: no identity collectives, torch's fused loss over
        # whole logits, and dropout from the default generator (which recompute restores itself).
        if sequence_parallel:
            raise ValueError("sequence parallelism needs a tensor-parallel group of more than one rank")
        if recompute != "none":
            apply_activation_checkpointing(model, RECOMPUTE_TARGETS[recompute], every, None)
        return model
    rng = TensorParallelRNG(seed, dist.get_rank(tp_group), device)
    model.tp_rng = rng  # its state belongs in checkpoints, for an exact resume with dropout
    apply_tensor_parallel(model, TP_PLAN, tp_group, rng=rng, sequence_parallel=sequence_parallel,
                          comm_mode=tp_comm)
    if recompute != "none":
        apply_activation_checkpointing(model, RECOMPUTE_TARGETS[recompute], every, rng)
    return model
