"""Writing a megazero training checkpoint from logical tensors, one tensor at a time.

The files are those a training run writes (``rank_XXXXX.safetensors`` with the flat master and
moment shards, ``rank_XXXXX.index.safetensors``, each rank's manifest, ``COMPLETE``, ``latest``),
laid out by a ``RankLayout``. A rank file's flat tensors are streamed segment by segment, each
logical tensor read from the source when its first segment comes up, so host memory holds one
logical tensor. Fresh optimizer state (zero moments, Adam step 0) is written without reading
anything.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Optional

import torch

from megazero.checkpoint import serialization
from megazero.checkpoint.format import (
    COMPLETE, FORMAT_VERSION, LATEST, HashingWriter, complete_text, rank_manifest_name, step_dir_name,
)
from megazero.checkpoint.reader import index_file, rank_file
from megazero.convert.layout import RankLayout, RankPlan
from megazero.convert.streaming import StreamedSafetensors, declare
from megazero.optim import STATE_KEYS, shard_description

ReadLogical = Callable[[str, tuple[str, ...]], dict[str, torch.Tensor]]
"""(logical name, keys) -> {key: the whole logical tensor, shaped as the layout's full shape}."""

FRESH_SCALER = {"kind": None}
"""No loss-scaler state: the run's own scaler starts afresh (a resume says so where that loses anything)."""


def write_checkpoint(root: Path, layout: RankLayout, read: ReadLogical, *, step: int, meta: dict,
                     with_moments: bool, adam_step: float = 0.0, scaler: Optional[dict] = None) -> Path:
    """Write checkpoint ``step`` under ``root`` (``root/step_N`` and ``root/latest``); returns its
    directory. ``with_moments`` False writes zero Adam moments and reads only the masters."""
    ckpt = root / step_dir_name(step)
    ckpt.mkdir(parents=True)
    files = {}
    for rank, plan in enumerate(layout.ranks):
        entries = _write_rank(ckpt, rank, plan, read, with_moments, adam_step, scaler or FRESH_SCALER)
        (ckpt / rank_manifest_name(rank)).write_text(json.dumps({"rank": rank, "step": step, "files": entries},
                                                                indent=1))
        files.update(entries)
    record = {"format": FORMAT_VERSION, "step": step, "world_size": len(layout.ranks),
              "meta": {**meta, "layout": layout.description}, "files": files}
    (ckpt / COMPLETE).write_text(complete_text(record))
    (root / LATEST).write_text(ckpt.name + "\n")
    return ckpt


def _write_rank(ckpt: Path, rank: int, plan: RankPlan, read: ReadLogical, with_moments: bool,
                adam_step: float, scaler: dict) -> dict:
    description = shard_description(plan.params, plan.segments)
    entries = {}
    with open(ckpt / index_file(rank), "wb") as f:
        writer = HashingWriter(f)
        serialization.write(description, writer)
    entries[index_file(rank)] = {"rank": rank, "bytes": writer.bytes, "sha256": writer.sha256.hexdigest()}
    flat = torch.empty(plan.numel, device="meta")
    tree = {**description, **{key: flat for key in STATE_KEYS}, "adam_step": float(adam_step), "scaler": scaler,
            "rng": {"cpu": torch.get_rng_state(), "tp": [None]}}
    metadata, tensors = declare(tree)
    out = StreamedSafetensors(ckpt / rank_file(rank), tensors, {serialization.TREE: metadata})
    for path, tensor in tensors.items():
        if path in STATE_KEYS:
            if path == "master" or with_moments:
                _stream_key(out, plan, read, path)
            else:
                out.write_zeros(plan.numel)
        else:
            out.write(tensor)
    entries[rank_file(rank)] = {"rank": rank, **out.close()}
    return entries


def _stream_key(out: StreamedSafetensors, plan: RankPlan, read: ReadLogical, key: str) -> None:
    """One flat shard tensor, in shard order: each segment's elements, zeros in the gaps."""
    position, cached = 0, (None, None)
    for param, param_offset, shard_offset, numel in sorted(plan.segments, key=lambda s: s[2]):
        name, local_shape, shard = plan.params[param]
        if cached[0] != name:
            cached = (None, None)  # drop the previous tensor before reading the next
            full = read(name, (key,))[key]
            cached = (name, (full if shard is None else shard.take(full)).reshape(-1))
        local = cached[1]
        if local.numel() != math.prod(local_shape):
            raise ValueError(f"{name}: the source gives {local.numel()} elements for a slice of shape {local_shape}")
        out.write_zeros(shard_offset - position)
        out.write(local[param_offset:param_offset + numel])
        position = shard_offset + numel
    out.write_zeros(plan.numel - position)

