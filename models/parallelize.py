"""Turn a plain GPT (or stage) into this rank's tensor-parallel, checkpointed part of it.

The model says *what* splits (``TP_PLAN``) and *what* to recompute (``RECOMPUTE_TARGETS``);
``parallel.tensor_parallel`` knows *how*. This file only joins the two and checks that the
model's widths divide by tp, naming the config field that does not.
"""

from __future__ import annotations

import torch.distributed as dist

from models.config import ModelConfig
from models.gpt import GPT, RECOMPUTE_TARGETS, TP_PLAN
from parallel import comm
from parallel.tensor_parallel.apply import apply_activation_checkpointing, apply_tensor_parallel
from parallel.tensor_parallel.random import TensorParallelRNG

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


def parallelize_gpt(model: GPT, tp_group, *, seed: int, device="cpu", sequence_parallel: bool = False,
                    recompute: str = "none", recompute_every: int = 1) -> GPT:
    """Apply tensor (and sequence) parallelism and activation checkpointing to ``model`` in place.

    ``seed`` seeds the tp dropout stream (offset by the tp rank); the caller seeds the default
    generator identically on all tp ranks. With a meta-device model, call ``to_empty`` and
    ``init_weights(seed)`` afterwards: each rank then materialises and draws only its shards.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute {recompute!r}: use one of {RECOMPUTE_MODES}")
    tp = comm.group_size(tp_group)
    check_tp_layout(model, tp)
    every = recompute_every if recompute == "full" else 1
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
    apply_tensor_parallel(model, TP_PLAN, tp_group, rng=rng, sequence_parallel=sequence_parallel)
    if recompute != "none":
        apply_activation_checkpointing(model, RECOMPUTE_TARGETS[recompute], every, rng)
    return model
