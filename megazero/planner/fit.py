"""The start-up memory check: the planner's estimate for the run about to start, against the device
memory it will meet (``train.memory_budget_gib`` where stated, else the GPU's own), and the nearest
layout that fits when it does not."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megazero.config.schema import Config
from megazero.planner.hardware import GIB, GPUS, Cluster, custom_gpu
from megazero.planner.memory import estimate_memory
from megazero.planner.search import layout_of, nearest_fitting


STATED = "train.memory_budget_gib"


@dataclass(frozen=True)
class Budget:
    gib: float
    source: str      # what the user changes to move it
    device: str      # the GPU preset whose speed ranks equally near layouts


def device_budget(cfg: Config) -> Optional[Budget]:
    """The memory a rank of this run may use, or None where nothing is known (a CPU run without
    ``train.memory_budget_gib``). A stated budget on a GPU run is less memory on that same GPU, so
    its speed still ranks the layouts; the H100 stands in where there is no GPU."""
    stated, props = cfg.train.memory_budget_gib, _visible_gpu(cfg)
    name = "" if props is None else props.name.upper()
    preset = next((k for k in GPUS if k.split("-")[0].upper() in name), "h100")
    if stated is not None:
        return Budget(stated, STATED, preset)
    if props is None:
        return None
    return Budget(props.total_memory / GIB, f"the {props.name}'s memory", preset)


def budget_problem(stated: float, device_gib: float, device: str) -> Optional[str]:
    """The line for a ``train.memory_budget_gib`` no rank can have, or None: not positive, or more than
    the ``device_gib`` ``device`` has (words such as "of the NVIDIA H200"). A budget is less memory on
    the same GPU; a larger one passed layouts that then ran out of memory."""
    if not stated > 0:
        return f"{STATED}: must be positive, got {stated}"
    if stated > device_gib:
        digits = decimals_apart(stated, device_gib)
        return (f"{STATED}: {stated:g} GiB is more than the {device_gib:.{digits}f} GiB {device}; lower it, or "
                "set it null to use the whole GPU")
    return None


def _device_word(cfg: Config) -> str:
    """What one rank's memory is called in the planner's lines: a GPU's, or, on a CPU run (whose
    stated budget stands in for a GPU's), a rank's."""
    return "GPU" if _visible_gpu(cfg) is not None else "rank"


def _visible_gpu(cfg: Config):
    """The properties of the GPU this run will train on, or None for a CPU run."""
    if cfg.train.device == "cpu":
        return None
    import torch

    return torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None


def estimate_line(cfg: Config) -> str:
    """What rank 0 prints at start-up."""
    budget = device_budget(cfg)
    against = f" of {budget.gib:.1f} GiB ({budget.source})" if budget else ""
    per = _device_word(cfg)
    return f"megazero: planner memory estimate {estimate_memory(cfg).describe(per, budget is not None)}{against}"


def memory_problem(cfg: Config, ranks_per_node: Optional[int] = None) -> Optional[str]:
    """One line when the run's layout is predicted not to fit its device memory, naming the nearest
    layout that does (or saying none does); None when it fits or no budget is known."""
    budget = device_budget(cfg)
    if budget is None:
        return None
    props = _visible_gpu(cfg)
    if budget.source == STATED:
        problem = budget_problem(budget.gib, props.total_memory / GIB if props else math.inf,
                                 f"of the {props.name}" if props else "")
        if problem:
            return problem
    needed = estimate_memory(cfg).needed / GIB
    if needed <= budget.gib:
        return None
    p = cfg.parallel
    world = p.tp * p.pp * p.dp
    digits = decimals_apart(needed, budget.gib)
    cluster = Cluster(custom_gpu(GPUS[budget.device], memory_gib=budget.gib), world, ranks_per_node or world)
    nearest = nearest_fitting(cfg, cluster)
    if nearest is None:
        fix = f"no layout of {world} GPUs fits; {none_fits_advice(cfg)}"
    else:
        changes = " ".join(nearest.layout.changes_from(layout_of(cfg))) or "(this layout with a smaller estimate)"
        fix = f"nearest layout that fits: {changes} ({nearest.memory.needed / GIB:.{digits}f} GiB)"
    return (f"memory: the planner predicts {needed:.{digits}f} GiB per {_device_word(cfg)} for tp{p.tp} pp{p.pp} "
            f"dp{p.dp} ZeRO-{cfg.zero.stage} (margins included) but {budget.gib:.{digits}f} GiB is available "
            f"({budget.source}); {fix}")


def none_fits_advice(cfg: Config, held: Optional[dict[str, object]] = None) -> str:
    """What could make a layout fit where none searched does: more GPUs, offloading the optimizer where
    it is not on, releasing the searched fields ``held`` at a value (``--section.field``: value; every
    value of the others was tried), a smaller model. Nothing already tried is suggested."""
    steps = ["add GPUs"]
    if not cfg.zero.offload_optimizer:
        steps.append("offload the optimizer (--zero.offload_optimizer true)")
    steps += [f"search {flag} instead of holding it at {value}" for flag, value in sorted((held or {}).items())]
    steps.append("shrink the model")
    return ", ".join(steps[:-1]) + " or " + steps[-1]


def decimals_apart(needed: float, budget: float) -> int:
    """The fewest decimals (one at least) that show ``needed`` above ``budget`` and a budget above 0 as
    more than 0: at one, 1.52 GiB needed of a 1.51 GiB budget read "1.5 GiB ... but 1.5 GiB is available"."""
    digits = 1
    while digits < 6 and (f"{needed:.{digits}f}" == f"{budget:.{digits}f}" or float(f"{budget:.{digits}f}") == 0):
        digits += 1
    return digits

