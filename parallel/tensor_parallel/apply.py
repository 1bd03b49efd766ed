"""Apply a model's tensor-parallel plan and activation checkpointing to a plain model.

A plan maps module-name patterns (``*`` stands for one dotted component, e.g. ``layers.*.mlp.fc_in``)
to a style. Patterns that match nothing are skipped, so one plan serves every pipeline stage.

| style            | applied to       | effect                                                            |
|------------------|------------------|-------------------------------------------------------------------|
| colwise          | nn.Linear        | replaced by ColumnParallelLinear                                  |
| rowwise          | nn.Linear        | replaced by RowParallelLinear                                     |
| vocab            | nn.Embedding     | replaced by VocabParallelEmbedding                                |
| vocab_loss       | loss module      | replaced by VocabParallelCrossEntropy (needs ``.vocab_size``)     |
| split_sequence   | any module       | sp: output split along the sequence                               |
| sequence         | norm, dropout    | sp: parameters marked partial (``partial_grads``), randomness     |
|                  |                  | from the tp stream (where it draws any: ``draws_random``)         |
| local            | any module       | randomness from the tp stream (it works on this rank's shard)     |

Module replacement keeps parameter names; the other styles wrap the module's ``forward`` on the
instance, which also keeps names (a wrapper module would rename every parameter under it).
"""

from __future__ import annotations

import fnmatch
import functools
from typing import Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallel.tensor_parallel.collectives import split_sequence
from parallel.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from parallel.tensor_parallel.partial_grads import mark_partial
from parallel.tensor_parallel.random import TensorParallelRNG
from parallel.tensor_parallel.sharding import Shard

REPLACEMENTS = {
    "colwise": (nn.Linear, ColumnParallelLinear.from_linear),
    "rowwise": (nn.Linear, RowParallelLinear.from_linear),
    "vocab": (nn.Embedding, VocabParallelEmbedding.from_embedding),
    "vocab_loss": (nn.Module, VocabParallelCrossEntropy.from_loss),
}
SPLIT_LAYERS = {"colwise": ColumnParallelLinear, "rowwise": RowParallelLinear, "vocab": VocabParallelEmbedding}
"""The styles that split parameters, and the layer whose ``SPLIT_DIMS`` say how."""
LINEAR_STYLES = ("colwise", "rowwise")
WRAPPERS = ("split_sequence", "sequence", "local")
STYLES = tuple(REPLACEMENTS) + WRAPPERS


def matching(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """Submodules whose dotted name matches ``pattern`` component by component, in model order."""
    parts = pattern.split(".")
    found = []
    for name, module in model.named_modules():
        names = name.split(".") if name else []
        if len(names) == len(parts) and all(fnmatch.fnmatchcase(n, p) for n, p in zip(names, parts)):
            found.append((name, module))
    return found


def wrap_forward(module: nn.Module, around: Callable) -> None:
    """Make ``module(...)`` call ``around(original_forward, *args, **kwargs)``."""
    module.forward = functools.partial(around, module.forward)


def _in_fork(rng: TensorParallelRNG, forward, *args, **kwargs):
    with rng.fork():
        return forward(*args, **kwargs)


def draws_random(module: nn.Module) -> bool:
    """Whether ``module`` uses the random stream: some dropout under it has a probability above zero,
    as an ``nn.Dropout`` or as a float ``dropout`` attribute (a module that calls a dropout function).

    Only those run inside the tp stream's fork: a fork saves and restores generator state, which
    torch.compile cannot trace, so each one splits a compiled block into more graphs, each with its
    own host-side cost per call."""
    return any((isinstance(m, nn.Dropout) and m.p > 0)
               or (isinstance(getattr(m, "dropout", None), float) and m.dropout > 0) for m in module.modules())


def _apply_wrapper(module: nn.Module, style: str, group, sequence_parallel: bool, rng: TensorParallelRNG) -> None:
    if style == "local" and draws_random(module):
        wrap_forward(module, functools.partial(_in_fork, rng))
    elif sequence_parallel and style == "split_sequence":
        wrap_forward(module, lambda forward, *a, **k: split_sequence(forward(*a, **k), group))
    elif sequence_parallel and style == "sequence":
        mark_partial(module, [name for name, p in module._parameters.items() if p is not None])
        if draws_random(module):
            wrap_forward(module, functools.partial(_in_fork, rng))


def apply_tensor_parallel(model: nn.Module, plan: dict[str, str], group, *, rng: TensorParallelRNG,
                          sequence_parallel: bool = False, comm_mode: str = "overlap") -> nn.Module:
    """Split ``model`` in place across the ranks of ``group`` as ``plan`` says; returns it.
    ``comm_mode``: how the sequence-parallel linears communicate (``overlap.MODES``).

    Call it on the model before ``init_weights`` if built on the meta device, after otherwise
    (each rank then keeps its slice of the initialised full weights). Tied parameters stay tied.
    """
    unknown = {style for style in plan.values() if style not in STYLES}
    if unknown:
        raise ValueError(f"unknown tensor-parallel styles {sorted(unknown)}; known: {STYLES}")
    memo: dict = {}
    for pattern, style in plan.items():
        for name, module in matching(model, pattern):
            if style in WRAPPERS:
                _apply_wrapper(module, style, group, sequence_parallel, rng)
                continue
            kind, build = REPLACEMENTS[style]
            if not isinstance(module, kind):
                raise ValueError(f"{name}: style {style!r} needs a {kind.__name__}, got {type(module).__name__}")
            parent_name, _, child = name.rpartition(".")
            extra = {"comm_mode": comm_mode} if style in LINEAR_STYLES else {}
            setattr(model.get_submodule(parent_name), child, build(module, group, sequence_parallel, memo, **extra))
    return model


def shard_meta_model(model: nn.Module, plan: dict[str, str], tp: int, tp_rank: int) -> nn.Module:
    """What ``apply_tensor_parallel`` does to a meta-device ``model``'s parameters on tp rank ``tp_rank``
    of ``tp``, without a process group: each split parameter becomes a meta parameter of its local
    shape, recorded in its module's ``tp_shards`` (so ``sharding.param_shards`` reads it). The layers
    are not replaced and nothing runs: this is for describing a layout offline (a checkpoint written
    for a run that has not started). A one-rank group splits nothing, as ``apply_tensor_parallel`` is
    then not applied at all."""
    if tp == 1:
        return model
    for pattern, style in plan.items():
        layer = SPLIT_LAYERS.get(style)
        if layer is None:
            continue
        for _, module in matching(model, pattern):
            shards = module.__dict__.setdefault("tp_shards", {})
            for attr, dim in layer.SPLIT_DIMS.items():
                param = getattr(module, attr, None)
                if dim is None or param is None:
                    continue
                shard = Shard(dim, tp_rank, tp)
                shape = list(param.shape)
                shape[dim] //= tp
                setattr(module, attr, nn.Parameter(torch.empty(shape, device="meta"), requires_grad=param.requires_grad))
                shards[attr] = shard
    return model


def apply_activation_checkpointing(model: nn.Module, pattern: str, every: int = 1,
                                   rng: Optional[TensorParallelRNG] = None) -> list[str]:
    """Recompute the forward of every ``every``-th module matching ``pattern`` in backward.

    Counting starts at the first match on this model (so a pipeline stage checkpoints its own first
    block). Dropout masks are reproduced: torch restores the default generator, ``rng`` the tp stream.
    Returns the names of the checkpointed modules.
    """
    if every < 1:
        raise ValueError(f"checkpoint every {every}-th module: must be at least 1")

    def around(forward, *args, replay=None, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        context = {} if replay is None else {"context_fn": replay}
        return checkpoint(forward, *args, use_reentrant=False, **context, **kwargs)

    chosen = _recomputed(model, pattern, every)
    for _, module in chosen:
        if rng is not None and draws_random(module):
            wrap_forward(module, functools.partial(around, replay=rng.checkpoint_contexts))
        else:
            wrap_forward(module, around)
    return [name for name, _ in chosen]


def tp_stream_replays(model: nn.Module, pattern: str, every: int = 1) -> list[str]:
    """The modules ``apply_activation_checkpointing(model, pattern, every, rng)`` recomputes inside the
    tp stream's replay: those that draw from it. The default generator torch's checkpoint restores
    itself, but the tp stream needs a context function, which torch.compile cannot trace."""
    return [name for name, module in _recomputed(model, pattern, every) if draws_random(module)]


def _recomputed(model: nn.Module, pattern: str, every: int) -> list[tuple[str, nn.Module]]:
    """Every ``every``-th module matching ``pattern``, counted from this model's first match."""
    return matching(model, pattern)[::every]
