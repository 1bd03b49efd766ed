"""Where each element of each logical parameter goes in the rank files of a checkpoint to be written.

A ``RankLayout`` says, for every rank of the target run, what its file holds: the parameters
(logical name, local shape, tensor-parallel slice or None), the segments placing them in the flat
shard (param index, offset in the parameter, offset in the shard, count) and the shard's length.
That is exactly the description a training rank writes (``describe_shard``), so the checkpoint
writer needs nothing else to lay a file out. ``consolidated`` is the one layout built here: one
rank, every parameter whole, one segment each -- which the trainer reshards on load into whatever
layout a run uses. A description of any other training layout, computed offline, plugs in the same
way (an object with ``ranks`` and ``description``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from parallel.tensor_parallel.sharding import Shard


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
        numel = 1
        for d in shape:
            numel *= d
        params.append((name, tuple(shape), None))
        segments.append((i, 0, offset, numel))
        offset += numel
    description = {"tp": 1, "pp": 1, "dp": 1, "virtual_stages": 1, "order": "tp-dp-pp", "zero_stage": 0,
                   "world_size": 1, "pipeline_split": [num_layers], "written_by": WRITTEN_BY}
    return Consolidated([RankPlan(params, segments, offset)], description)
