"""Enumerate the layouts a config could run with on a cluster, keep those the trainer's own
validation accepts, and rank them by predicted speed among those that fit in memory."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Iterator, Optional

from megazero.config.auto import resolve_auto
from megazero.config.schema import Config
from megazero.config.validate import CHOICES, validate_config
from megazero.errors import ConfigError
from megazero.planner.hardware import GIB, Cluster
from megazero.planner.memory import MemoryEstimate, estimate_memory, rank_chunks
from megazero.planner.time import StepEstimate, estimate_step
from models.config import ModelConfig
from models.gpt import GPT
from models.parallelize import recompute_replays_tp_stream, tp_layout_problems
from parallel.pipeline.partition import BLOCK_PARTS
from parallel.pipeline.placement import V_SHAPED
from parallel.pipeline.schedule import SPLIT_BACKWARD, schedule_problem

VIRTUAL_STAGES = (1, 2)
MAX_MICRO_BATCH = 32


@dataclass(frozen=True)
class Layout:
    """The knobs the planner turns; everything else comes from the config unchanged."""

    tp: int
    pp: int
    dp: int
    virtual_stages: int
    zero_stage: int
    micro_batch_size: int
    recompute: str
    sequence_parallel: bool
    schedule: str

    def overrides(self) -> list[str]:
        """The ``megazero train`` flags that select this layout. dp among them: it follows from the world
        size only where the config leaves it unset, and one that names it refused the layout's tp and
        pp beside its own dp."""
        return ["--parallel.tp", str(self.tp), "--parallel.pp", str(self.pp), "--parallel.dp", str(self.dp),
                "--parallel.virtual_stages", str(self.virtual_stages), "--zero.stage", str(self.zero_stage),
                "--train.micro_batch_size", str(self.micro_batch_size), "--parallel.recompute", self.recompute,
                "--parallel.sequence_parallel", str(self.sequence_parallel).lower(),
                "--parallel.pipeline_schedule", self.schedule]

    def changes_from(self, other: "Layout") -> list[str]:
        """The flags of this layout whose values differ from ``other``'s."""
        mine, theirs = self.overrides(), other.overrides()
        return [f"{mine[i]} {mine[i + 1]}" for i in range(0, len(mine), 2) if mine[i + 1] != theirs[i + 1]]

    def knobs_changed(self, other: "Layout") -> int:
        """How many of ``other``'s choices this layout changes: dp is not one, in a world of the same
        size it follows from tp and pp."""
        return sum(not flag.startswith("--parallel.dp ") for flag in self.changes_from(other))


KNOBS = {"parallel.tp": "tp", "parallel.pp": "pp", "parallel.dp": "dp", "parallel.virtual_stages": "virtual_stages",
         "zero.stage": "zero_stage", "train.micro_batch_size": "micro_batch_size", "parallel.recompute": "recompute",
         "parallel.sequence_parallel": "sequence_parallel", "parallel.pipeline_schedule": "schedule"}
"""The config fields the planner searches, by the ``Layout`` field each sets."""


LEAST_MEMORY = {"train.micro_batch_size": "1", "parallel.recompute": "full", "parallel.sequence_parallel": "true"}
"""Searched fields at the value no other value of theirs needs less memory than."""


def held_knobs(cfg: Config, fixed: frozenset[str]) -> dict[str, str]:
    """The searched fields ``fixed`` holds at ``cfg``'s values, by flag, spelled as the flags take them,
    but for those at their ``LEAST_MEMORY`` value: searching those could add no layout that fits."""
    own = layout_of(cfg)
    flags = own.overrides()
    spelled = dict(zip(flags[::2], flags[1::2]))
    return {f"--{key}": spelled[f"--{key}"] for key in sorted(fixed) if LEAST_MEMORY.get(key) != spelled[f"--{key}"]}


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    step: StepEstimate
    fits: bool


def layout_of(cfg: Config) -> Layout:
    p = cfg.parallel
    return Layout(p.tp, p.pp, p.dp, p.virtual_stages, cfg.zero.stage, cfg.train.micro_batch_size, p.recompute,
                  p.sequence_parallel, p.pipeline_schedule)


def apply_layout(cfg: Config, layout: Layout) -> Config:
    parallel = dataclasses.replace(cfg.parallel, tp=layout.tp, pp=layout.pp, dp=layout.dp,
                                   virtual_stages=layout.virtual_stages, recompute=layout.recompute,
                                   sequence_parallel=layout.sequence_parallel, pipeline_schedule=layout.schedule)
    return dataclasses.replace(cfg, parallel=parallel, zero=dataclasses.replace(cfg.zero, stage=layout.zero_stage),
                               train=dataclasses.replace(cfg.train, micro_batch_size=layout.micro_batch_size))


def evaluate(cfg: Config, cluster: Cluster) -> Candidate:
    """Memory and step time of ``cfg``'s own layout (``parallel.dp`` set) on ``cluster``."""
    memory = estimate_memory(cfg)
    return Candidate(layout_of(cfg), memory, estimate_step(cfg, cluster),
                     memory.needed <= cluster.gpu.memory_gib * GIB)


def is_valid(cfg: Config, cluster: Cluster) -> bool:
    """The trainer's own verdict on the layout for this world (every rule of config validation, and
    the engine's refusal of recompute it cannot compile)."""
    try:
        validate_config(cfg, cluster.num_gpus, cluster.gpus_per_node)
    except ConfigError:
        return False
    return not recompute_refused(cfg)


def recompute_refused(cfg: Config, on_cuda: bool = True) -> bool:
    """Whether the engine, building this layout on GPUs (``on_cuda``; else the CPU) with
    ``train.compile`` resolved there, refuses its recompute (``engine.RECOMPUTE_REPLAY_PROBLEM``):
    under tensor parallelism a recomputed module that draws dropout replays the tensor-parallel
    random stream, which torch.compile cannot trace. The engine asks it of the built blocks, so
    validation cannot; here each kind of block a chunk recomputes is asked once."""
    p = cfg.parallel
    if p.tp == 1 or p.recompute == "none" or not resolve_auto(cfg, on_cuda=on_cuda, peer_memory=True).train.compile:
        return False
    every = p.recompute_every if p.recompute == "full" else 1  # the attention core is recomputed in every block
    model = tuple(vars(cfg.model).items())
    return any(_block_replays(model, parts, p.recompute)
               for rank in range(p.pp) for chunk in rank_chunks(cfg, rank) for parts in chunk[::every])


@functools.lru_cache(maxsize=256)
def _block_replays(model_fields: tuple, parts: tuple[str, ...], recompute: str) -> bool:
    """Whether recomputing one block holding ``parts`` replays the tensor-parallel random stream."""
    block = GPT(ModelConfig(**dict(model_fields)), layers=[0], has_embedding=False, has_head=False, device="meta",
                parts=None if parts == BLOCK_PARTS else {0: parts})
    return bool(recompute_replays_tp_stream(block, recompute))


def _powers_of_two(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]


def candidate_layouts(cfg: Config, cluster: Cluster) -> Iterator[Layout]:
    """Every combination worth asking validation about: tp a power of two within a node, pp any
    divisor of the rest, one or two virtual stages, every ZeRO stage, power-of-two micro-batches,
    every recompute mode, sequence parallelism on and off, and for a pipeline of one chunk a rank the
    zero-bubble schedules beside the default (the config's own values always included)."""
    n, own = cluster.num_gpus, cfg.parallel
    tps = sorted(set(_powers_of_two(cluster.gpus_per_node)) | {own.tp})
    for tp in tps:
        if n % tp:
            continue
        for pp in (k for k in range(1, min(n // tp, cfg.model.num_layers) + 1) if (n // tp) % k == 0):
            dp = n // (tp * pp)
            per_replica = cfg.train.global_batch_size // dp
            mbs_choices = sorted(set(_powers_of_two(min(per_replica, MAX_MICRO_BATCH))) | {cfg.train.micro_batch_size})
            for v in sorted(set(VIRTUAL_STAGES) | {own.virtual_stages}):
                for stage in CHOICES["zero.stage"]:
                    for mbs in mbs_choices:
                        for recompute in CHOICES["parallel.recompute"]:
                            for sp in (False, True) if tp > 1 else (False,):
                                for schedule in _schedules(pp, v, own.pipeline_schedule):
                                    yield Layout(tp, pp, dp, v, stage, mbs, recompute, sp, schedule)


def _schedules(pp: int, v: int, own: str) -> list[str]:
    """The default schedule, and for a pipeline the split-backward ones that run its chunks a rank.
    ZB-V only where the config names it: its equal-cost bubble is half ZB-H1's, but on two H200s it
    ran GPT 1.3B 1% slower than ZB-H2 (BENCHMARKS.md), so the model would rank it above a faster one."""
    if pp == 1:
        return sorted({"auto", own})
    return sorted({"auto", own} | {name for name in SPLIT_BACKWARD
                                   if name not in V_SHAPED and schedule_problem(name, v) is None})


def split_worlds(cfg: Config, gpus: int, gpus_per_node: int) -> list[int]:
    """The GPU counts, up to ``gpus`` and in whole nodes beyond one, that split as tp x pp x dp the way
    the search splits them (tp a power of two within a node that the model's widths divide, pp at most
    a stage a block, dp a divisor of the global batch), most first: a world not among them has no
    valid layout, and the plan offers one of these instead (``usable_world``). The splits themselves
    are enumerated, not the worlds below ``gpus``: a --gpus with a few zeros too many would take
    minutes to count down."""
    tps = [tp for tp in _powers_of_two(gpus_per_node) if not tp_layout_problems(cfg.model, tp)]
    batch = cfg.train.global_batch_size
    dps = {d for k in range(1, math.isqrt(batch) + 1) if batch % k == 0 for d in (k, batch // k)}
    worlds = (tp * pp * dp for tp in tps for pp in range(1, cfg.model.num_layers + 1) for dp in dps
              if tp * pp * dp <= gpus_per_node or (tp * pp * dp % gpus_per_node == 0 and gpus_per_node % tp == 0))
    return sorted({world for world in worlds if world <= gpus}, reverse=True)


WORLDS_TRIED = 16
"""How many of the split worlds, most GPUs first, ``usable_world`` plans before it gives up."""


def usable_world(cfg: Config, cluster: Cluster) -> int:
    """The most GPUs, up to the cluster's, on which some layout of ``cfg`` is valid (0: none among the
    first ``WORLDS_TRIED`` that split): a world that splits may still have none, its pp forbidden by
    ``train.cuda_graphs``, say, and the batch not dividing over the dp left."""
    for world in split_worlds(cfg, cluster.num_gpus, cluster.gpus_per_node)[:WORLDS_TRIED]:
        there = dataclasses.replace(cluster, num_gpus=world, gpus_per_node=min(cluster.gpus_per_node, world))
        if any(is_valid(apply_layout(cfg, layout), there) for layout in candidate_layouts(cfg, there)):
            return world  # validity alone: no layout's memory and time are needed for the count
    return 0


def plan(cfg: Config, cluster: Cluster, fixed: frozenset[str] = frozenset()) -> list[Candidate]:
    """Valid layouts: those that fit first, fastest first, then the rest by memory needed. ``fixed``:
    the searched config fields (``KNOBS``' keys) held at ``cfg``'s values instead of searched."""
    own = layout_of(cfg)
    held = {KNOBS[key]: getattr(own, KNOBS[key]) for key in fixed}
    found = []
    for layout in candidate_layouts(cfg, cluster):
        if any(getattr(layout, name) != value for name, value in held.items()):
            continue
        candidate_cfg = apply_layout(cfg, layout)
        if is_valid(candidate_cfg, cluster):
            found.append(evaluate(candidate_cfg, cluster))
    # Among equally fast layouts, the one closest to the config's own: no knob moves for nothing.
    # Those that do not fit come nearest to fitting first: when none fits, the table's top rows
    # are the layouts worth adding memory or GPUs for.
    return sorted(found, key=lambda c: (not c.fits, step_time(c) if c.fits else c.memory.needed,
                                        c.layout.knobs_changed(own), c.memory.needed))


def nearest_fitting(cfg: Config, cluster: Cluster) -> Optional[Candidate]:
    """The fitting layout that changes fewest of ``cfg``'s knobs; among equals the fastest, then the
    one that uses the most of the memory (the smallest step back from what was asked)."""
    own = layout_of(cfg)
    fitting = [c for c in plan(cfg, cluster) if c.fits]
    if not fitting:
        return None
    return min(fitting, key=lambda c: (c.layout.knobs_changed(own), step_time(c), -c.memory.needed))


def step_time(candidate: Candidate) -> float:
    """The predicted step to nine significant digits, as layouts are ranked: the same time summed in
    another order (ZeRO 1 against 3 where nothing of the data-parallel traffic shows) differs in its
    last bit, and that bit ranked a layout of more changed knobs above one of fewer."""
    return float(f"{candidate.step.step_s:.9g}")
