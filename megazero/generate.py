"""Sampling text from a checkpoint on one process, whatever layout trained it.

The checkpoint's fp32 master weights are reassembled into the single-device model (the same
resharding a layout change uses), so a model trained at tp2 x pp2 x dp2 samples on a laptop.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from megazero.checkpoint import CheckpointError, read_manifest, resolve_checkpoint
from megazero.checkpoint.state import fit_to_shard, load_full_weights
from megazero.config.loader import build_dataclass, known_fields
from megazero.config.schema import Config
from megazero.convert.sources import finite
from models import GPT
from models.decode_graph import DecodeGraph
from models.kv_cache import KVCache


@dataclass(frozen=True)
class OpenedCheckpoint:
    """A checkpoint directory and its ``COMPLETE`` record, read and checked once. Everything a command
    learns of the checkpoint comes from this one record, and its weights are verified against it: a
    directory replaced after it was read (a training run re-saving that step, or its retention
    deleting it) is refused when the weights are read, never loaded as another run's weights under
    this one's config."""

    path: Path
    manifest: dict
    source: str  # what the user set to name it, for the error messages

    @property
    def meta(self) -> dict:
        return self.manifest["meta"]


def open_checkpoint(path, source: str = "the checkpoint path") -> OpenedCheckpoint:
    """The checkpoint ``path`` names (itself, or the latest under it), with its record read once."""
    ckpt = resolve_checkpoint(path, source=source)
    return OpenedCheckpoint(ckpt, read_manifest(ckpt), source)


def saved_config(ckpt: OpenedCheckpoint) -> Config:
    """The config a checkpoint was trained with, from its record alone: what the model will be is
    known, and can be checked, before its weights are read."""
    saved = ckpt.meta.get("config")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{ckpt.path}: records no training config, so it was not saved by `megazero train`; "
                              f"check {ckpt.source}")
    known, dropped = known_fields(Config, saved)  # fields of the version that wrote it, dropped since
    unknown_model = [name for name in dropped if name.startswith("model.")]
    if unknown_model:  # the rest (parallel layout, logging, ...) does not change what the model computes
        raise CheckpointError(f"{ckpt.path}: its model sets {', '.join(unknown_model)}, which this version of "
                              "megazero does not know; sample from it with the version that trained it")
    return build_dataclass(Config, known, prefix="")


def load_model(path, source: str = "the checkpoint path") -> tuple[GPT, Config]:
    """The single-process GPT holding a checkpoint's weights, and the config it was trained with.
    ``source`` names where ``path`` came from, for the error messages."""
    return load_opened(open_checkpoint(path, source))


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The weights' dtypes ``generate`` runs in: the checkpoint's fp32 master, or rounded to 16 bits (half
the memory, and on a GPU about half the time a drawn token takes: its reads are the weights)."""


def load_opened(ckpt: OpenedCheckpoint, dtype: torch.dtype = torch.float32) -> tuple[GPT, Config]:
    """``load_model`` for a checkpoint already opened: config and weights from its one record; the
    weights rounded to ``dtype`` (the rotary tables stay fp32, as in training, rounded per use)."""
    cfg = saved_config(ckpt)
    model = GPT(cfg.model, seed=cfg.train.seed)
    weights = load_full_weights(ckpt.path, ckpt.manifest)
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = finite(weights[name], f"{ckpt.path}: parameter {name!r}")  # NaN logits would pass for token 0
            param.copy_(fit_to_shard(value, None, tuple(param.shape), name, ckpt.path))
    overflowed = round_weights(model, dtype)
    if overflowed is not None:  # fp16 ends at 65504: inf logits would draw token 0
        short = next(key for key, value in DTYPES.items() if value == dtype)
        raise CheckpointError(f"{ckpt.path}: parameter {overflowed!r} holds values past {short}'s range; "
                              "sample in bf16 or fp32")
    return model.eval(), cfg


@torch.no_grad()
def round_weights(model: GPT, dtype: torch.dtype) -> str | None:
    """Round ``model``'s parameters to ``dtype`` in place (each stays the same parameter, so a tied head
    stays the embedding; buffers such as the rotary tables stay fp32); the name of the first one that
    left ``dtype``'s range, else None."""
    overflowed = None
    for name, param in model.named_parameters():
        param.data = param.data.to(dtype)
        if overflowed is None and not torch.isfinite(param).all():
            overflowed = name
    return overflowed


@torch.no_grad()
def sample(model: GPT, tokens: list[int], new_tokens: int, temperature: float = 0.8, top_k: int = 40,
           seed: int = 0, ids: Sequence[int] | None = None, stop: Collection[int] = (),
           device: torch.device | str = "cpu") -> list[int]:
    """Top-k sampling among ``ids`` (default: the model's vocabulary; a tokenizer decodes only the ids
    it has a token for, which may leave gaps below its largest) until ``new_tokens`` are drawn or an
    id in ``stop`` is (the end of a document: what follows it was trained as the start of an
    unrelated one). While prompt and draws fit the model's ``seq_length`` a ``KVCache`` keeps what
    was read, so each draw reads one token (on a GPU, replayed from a ``DecodeGraph``); past it,
    each draw reads the last ``seq_length`` tokens afresh (every one of them then sits a position
    earlier than when it was read). The model is on ``device``, and so are the choice of the top-k
    and the greedy argmax (a vocabulary's logits copied to the host each draw cost a GPU decode more
    than its products); the draw among the top-k is made on the CPU, so a seed gives the same text
    on any device the logits agree on. Appends to ``tokens`` (the prompt) in place and returns it,
    so a run stopped by Ctrl-C or SIGTERM leaves what it sampled there."""
    generator = torch.Generator().manual_seed(seed)
    drawable = torch.arange(model.vocab_size) if ids is None else torch.tensor(sorted(set(ids)), dtype=torch.long)
    drawable = drawable.to(device)
    context = model.cfg.seq_length
    cache = KVCache(min(context, len(tokens) + new_tokens))  # what the draws read, not the whole context
    graph = None
    for _ in range(new_tokens):
        if len(tokens) <= context:
            fresh = torch.tensor([tokens[cache.length:]], device=device)
            if graph is None and cache.length and fresh.device.type == "cuda":  # the prompt is read
                graph = DecodeGraph(model, cache, batch=1, device=fresh.device)
            out = model.decode(fresh, cache) if graph is None else graph(fresh)
        else:
            out = model(torch.tensor([tokens[-context:]], device=device))[:, -1]
        logits = out[0, :model.vocab_size].float()[drawable]
        if temperature <= 0:
            tokens.append(int(drawable[logits.argmax()]))
        else:
            values, indices = torch.topk(logits, min(top_k, logits.numel()))
            values, indices = values.cpu(), drawable[indices].cpu()
            # from the largest down: a tiny temperature then gives -inf (probability 0), never inf - inf; in
            # float64, as a temperature below float32's range would round to 0 and give 0 / 0 for the largest
            scaled = (values - values[0]).double() / temperature
            choice = torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator)
            tokens.append(int(indices[choice]))
        if tokens[-1] in stop:
            break
    return tokens
