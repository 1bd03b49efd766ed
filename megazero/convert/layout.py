"""Where each element of each logical parameter goes in the rank files of a checkpoint to be written.

A ``RankLayout`` says, for every rank of the target run, what its file holds: the parameters
(logical name, local shape, tensor-parallel slice or None), the segments placing them in the flat
shard (param index, offset in the parameter, offset in the shard, count) and the shard's length.
That is exactly the description a training rank writes (``ShardedAdamW.describe``), so the
checkpoint writer needs nothing else to lay a file out. Two layouts are built here:

* ``consolidated``: one rank, every parameter whole, one segment each;
* ``training_layout``: every rank of a run of a given config (tp, pp, dp, virtual stages, ZeRO
  stage, buckets, precision), computed the way the engine lays it out but without a process group:
  the rank's chunks are built on the meta device, given the shapes tensor parallelism would give
  them (``shard_meta_model``) and laid out by the data-parallel wrapper's own ``flat_layout``.

The trainer reshards either on load into whatever layout a run uses; a checkpoint written in a run's
own layout lets each of its ranks read only the files of its pipeline stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Protocol

from megazero.config import Config
from megazero.engine import build_chunks, data_parallel_settings, layout_record
from models.gpt import TP_PLAN
from models.parallelize import describe_params
from parallel.data_parallel.wrapper import flat_layout
from parallel.tensor_parallel.apply import shard_meta_model
from parallel.tensor_parallel.sharding import Shard
from parallel.topology import RankGrid


@dataclass(frozen=True)
class RankPlan:
    params: list[tuple[str, tuple[int, ...], Optional[Shard]]]
    segments: list[tuple[int, int, int, int]]
    numel: int  # elements in the flat shard (segments may leave padding between them)


class RankLayout(Protocol):
    ranks: list[RankPlan]
    description: dict
    """Recorded as the checkpoint's ``meta["layout"]``."""


WRITTEN_BY = "megazero convert"


@dataclass(frozen=True)
class Consolidated:
    ranks: list[RankPlan]
    description: dict


def consolidated(shapes: dict[str, tuple[int, ...]], num_layers: int) -> Consolidated:
    """World size 1: every parameter of ``shapes`` (logical name -> full shape, in model order)
    whole, one after the other. The layout record names the converter, so it never equals a
    training run's and loading always takes the resharding path (which reads no RNG state)."""
    params, segments, offset = [], [], 0
    for i, (name, shape) in enumerate(shapes.items()):
        numel = math.prod(shape)
        params.append((name, tuple(shape), None))
        segments.append((i, 0, offset, numel))
        offset += numel
    description = {"tp": 1, "pp": 1, "dp": 1, "virtual_stages": 1, "order": "tp-dp-pp", "zero_stage": 0,
                   "world_size": 1, "pipeline_split": [num_layers], "written_by": WRITTEN_BY}
    return Consolidated([RankPlan(params, segments, offset)], description)


@dataclass(frozen=True)
class TrainingLayout:
    ranks: list[RankPlan]
    description: dict


def training_layout(cfg: Config) -> TrainingLayout:
    """Every rank's shard description for a run of ``cfg`` (a validated config whose ``parallel.dp``
    is set), by global rank, equal to what that run's ``ShardedAdamW.describe()`` returns on each rank."""
    p = cfg.parallel
    grid = RankGrid(tp=p.tp, pp=p.pp, dp=p.dp, order=p.order)
    settings = data_parallel_settings(cfg)
    ranks = []
    for rank in range(grid.world_size):
        coord = grid.coord(rank)
        chunks = build_chunks(cfg, coord.pp)
        for chunk in chunks:
            shard_meta_model(chunk, TP_PLAN, p.tp, coord.tp)
            chunk.tie_weights()
        units = [block for chunk in chunks for block in chunk.layers.values()]
        params, _, layout = flat_layout(chunks, units, settings, p.dp, coord.dp)
        info = describe_params(chunks, coord.tp, tied=p.pp > 1)
        ranks.append(RankPlan([(info(q).name, tuple(q.shape), info(q).shard) for q in params],
                              [(s.param, s.param_offset, s.shard_offset, s.numel) for s in layout.segments],
                              layout.shard_numel))
    return TrainingLayout(ranks, {**layout_record(cfg), "written_by": WRITTEN_BY})
