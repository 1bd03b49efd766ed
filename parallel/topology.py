"""Where each rank sits in the tp x dp x pp grid, and the process groups that follow from it.

``RankGrid`` is pure arithmetic (no processes), so a 2240-rank MT-NLG layout can be checked in a
unit test. ``Topology`` builds the real groups from a grid and is the one object that holds them:
it is passed explicitly to whatever communicates; there is no module-level group state.

Ranks are numbered with the tensor axis fastest, so a tensor group is a run of consecutive ranks
and lands inside one node (NVLink) whenever tp divides the ranks per node. The default order
``tp-dp-pp`` then puts data-parallel replicas next (Megatron and DeepSpeed do the same) and
pipeline stages slowest, across nodes; ``tp-pp-dp`` swaps the two slower axes.
"""

from __future__ import annotations

import datetime
import itertools
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

ORDERS = ("tp-dp-pp", "tp-pp-dp")
PIPELINE_KINDS = ("pp", "pp_grad", "pp_back", "pp_grad_back")
GROUP_KINDS = ("tp", "dp", *PIPELINE_KINDS, "mp", "embedding")
"""``pp_grad`` holds the same ranks as ``pp``: a second communicator, so that the pipeline's gradients
travel apart from its activations (``parallel.pipeline.plan.CHANNELS``); ``pp_back`` and
``pp_grad_back`` are two more for a V-shaped pipeline's return leg (``plan.BACK_CHANNELS``). NCCL
sets a communicator up at its first use, so on GPUs those cost nothing to a run that never uses them
(gloo connects a group as it is made)."""


@dataclass(frozen=True)
class Coord:
    tp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class RankGrid:
    tp: int
    pp: int
    dp: int
    order: str = "tp-dp-pp"

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        if min(self.tp, self.pp, self.dp) < 1:
            raise ValueError(f"grid sizes must be positive: tp={self.tp} pp={self.pp} dp={self.dp}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank_of(self, tp: int, dp: int, pp: int) -> int:
        if self.order == "tp-dp-pp":
            return tp + self.tp * (dp + self.dp * pp)
        return tp + self.tp * (pp + self.pp * dp)

    def coord(self, rank: int) -> Coord:
        tp, rest = rank % self.tp, rank // self.tp
        if self.order == "tp-dp-pp":
            return Coord(tp=tp, dp=rest % self.dp, pp=rest // self.dp)
        return Coord(tp=tp, dp=rest // self.pp, pp=rest % self.pp)

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of ``kind``, each a sorted list of global ranks, in a fixed order."""
        tps, dps, pps = range(self.tp), range(self.dp), range(self.pp)
        if kind == "tp":
            return [[self.rank_of(t, d, p) for t in tps] for p, d in itertools.product(pps, dps)]
        if kind == "dp":
            return [[self.rank_of(t, d, p) for d in dps] for p, t in itertools.product(pps, tps)]
        if kind in PIPELINE_KINDS:
            return [[self.rank_of(t, d, p) for p in pps] for d, t in itertools.product(dps, tps)]
        if kind == "mp":  # tensor x pipeline: one model replica, for norms and overflow flags
            return [sorted(self.rank_of(t, d, p) for p, t in itertools.product(pps, tps)) for d in dps]
        if kind == "embedding":  # first and last stage of each pipeline share the tied embedding
            return [sorted({pipe[0], pipe[-1]}) for pipe in self.groups("pp")]
        raise ValueError(f"unknown group kind {kind!r}; expected one of {GROUP_KINDS}")

    def group_of(self, kind: str, rank: int) -> list[int]:
        c = self.coord(rank)
        if kind == "tp":
            return [self.rank_of(t, c.dp, c.pp) for t in range(self.tp)]
        if kind == "dp":
            return [self.rank_of(c.tp, d, c.pp) for d in range(self.dp)]
        if kind in PIPELINE_KINDS:
            return [self.rank_of(c.tp, c.dp, p) for p in range(self.pp)]
        if kind == "mp":
            return sorted(self.rank_of(t, c.dp, p) for p in range(self.pp) for t in range(self.tp))
        if kind == "embedding":
            pipe = self.group_of("pp", rank)
            return sorted({pipe[0], pipe[-1]}) if rank in (pipe[0], pipe[-1]) else []
        raise ValueError(f"unknown group kind {kind!r}; expected one of {GROUP_KINDS}")

    def within_nodes(self, kind: str, ranks_per_node: int) -> bool:
        """Whether every group of ``kind`` sits in one node of ``ranks_per_node`` consecutive ranks (its
        traffic stays on NVLink). Each group is sorted, so its first and last rank decide; a group no
        wider than a node may still start near a node's end (tp2 x dp3 x pp4 at 8 a node: dp [6, 8, 10])."""
        return all(group[0] // ranks_per_node == group[-1] // ranks_per_node for group in self.groups(kind))

    def tp_within_nodes(self, ranks_per_node: int) -> bool:
        """Whether every tensor group sits in one node: ``within_nodes`` for ``tp``, the one rule the
        launch check and the planner's costs share."""
        return self.within_nodes("tp", ranks_per_node)

    def describe(self, ranks_per_node: Optional[int] = None) -> str:
        """One line for the start-up log, e.g. ``tp8 x dp8 x pp35 = 2240 ranks on 280 nodes; ...``."""
        axes = " x ".join(f"{a}{getattr(self, a)}" for a in self.order.split("-"))
        line = f"{axes} = {self.world_size} rank{'s' if self.world_size > 1 else ''}"
        if ranks_per_node:
            nodes = -(-self.world_size // ranks_per_node)
            where = "within nodes" if self.tp_within_nodes(ranks_per_node) else "SPANNING nodes"
            line += f" on {nodes} node{'s' if nodes > 1 else ''}; tp groups {where}"
        return line


class Topology:
    """This rank's place in the grid and its process groups (built collectively by all ranks).

    Every rank must construct it at the same time: ``new_group`` is a collective call, so all
    groups of every kind are created on every rank in the same order, and each rank keeps the
    ones it belongs to.
    """

    def __init__(self, grid: RankGrid, rank: Optional[int] = None, ranks_per_node: Optional[int] = None,
                 timeout_s: Optional[float] = None):
        """``timeout_s``: how long the groups' collectives wait for a peer (None: torch's default, 30
        minutes on gloo and 10 on NCCL, which a group takes whatever the default group's is)."""
        world = dist.get_world_size()
        if grid.world_size != world:
            raise ValueError(f"grid {grid.describe()} does not match the world size {world}")
        self.grid = grid
        self.rank = dist.get_rank() if rank is None else rank
        self.coord = grid.coord(self.rank)
        self.ranks_per_node = ranks_per_node
        self._groups: dict[str, Optional[dist.ProcessGroup]] = {}
        self._members: dict[str, list[int]] = {}
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        for kind in GROUP_KINDS:
            for members in grid.groups(kind):
                group = dist.new_group(members, timeout=timeout, group_desc=kind) if world > 1 else dist.group.WORLD
                if self.rank in members and kind not in self._groups:
                    self._groups[kind], self._members[kind] = group, members

    def group(self, kind: str) -> Optional[dist.ProcessGroup]:
        """The group of ``kind`` holding this rank (``None`` for the embedding group off its stages)."""
        return self._groups.get(kind)

    def members(self, kind: str) -> list[int]:
        return self._members.get(kind, [])

    tp_group = property(lambda self: self._groups["tp"])
    dp_group = property(lambda self: self._groups["dp"])
    pp_group = property(lambda self: self._groups["pp"])
    pp_grad_group = property(lambda self: self._groups["pp_grad"])
    mp_group = property(lambda self: self._groups["mp"])
    embedding_group = property(lambda self: self._groups.get("embedding"))
    tp_size = property(lambda self: self.grid.tp)
    dp_size = property(lambda self: self.grid.dp)
    pp_size = property(lambda self: self.grid.pp)
    tp_rank = property(lambda self: self.coord.tp)
    dp_rank = property(lambda self: self.coord.dp)
    pp_rank = property(lambda self: self.coord.pp)

    @property
    def is_first_stage(self) -> bool:
        return self.coord.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord.pp == self.grid.pp - 1

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline stage ``pp_rank`` in this rank's pipeline."""
        return self.grid.rank_of(self.coord.tp, self.coord.dp, pp_rank % self.grid.pp)

    def describe(self) -> str:
        return self.grid.describe(self.ranks_per_node)
