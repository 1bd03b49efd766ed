"""The single-process run every parallel layout is compared with: the whole GPT in fp32 on one
device, trained with torch's AdamW (weight decay on matrices only, as the engine does) on the same
batches, its loss the per-token mean reached through the model alone, not the engine's summed path
(every label in these batches is real, so that mean is the engine's loss).

A test world compares many cases with one reference (every ZeRO stage of a layout, every schedule
of a pipeline), and every rank computes it: each process keeps the runs it made, keyed by all they
depend on, and hands out copies."""

from __future__ import annotations

import copy
import hashlib
from typing import Callable

import torch

from models import GPT

_RUNS: dict[tuple, tuple] = {}


def train_reference(cfg, batches_of_step: Callable[[int], list[dict]], steps: int):
    """``steps`` AdamW steps of ``cfg``'s model (optimizer settings from ``cfg``) on
    ``batches_of_step(step)``: the trained model, the loss and the gradient norm before clipping of
    each step."""
    batches = [batches_of_step(step) for step in range(steps)]
    key = (repr(cfg.model), cfg.parallel.tp, cfg.train.seed, repr(cfg.optimizer), _digest(batches))
    if key not in _RUNS:
        _RUNS[key] = _train(cfg, batches)
    model, losses, norms = _RUNS[key]
    return copy.deepcopy(model), list(losses), list(norms)


def _digest(batches: list[list[dict]]) -> str:
    h = hashlib.sha256()
    for step in batches:
        for mb in step:
            for name in sorted(mb):
                h.update(f"{name}{tuple(mb[name].shape)}{mb[name].dtype}".encode())
                h.update(mb[name].contiguous().numpy().tobytes())
    return h.hexdigest()


def _train(cfg, batches: list[list[dict]]):
    model = GPT(cfg.model, vocab_multiple=128 * cfg.parallel.tp, seed=cfg.train.seed)
    params = list(model.parameters())
    o = cfg.optimizer
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    losses, norms = [], []
    for step_batches in batches:
        opt.zero_grad()
        loss = sum(model(mb["tokens"], mb["labels"]).mean() for mb in step_batches) / len(step_batches)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, o.clip_grad).item())
        opt.step()
        losses.append(loss.item())
    return model, losses, norms
