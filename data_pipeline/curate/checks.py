"""Range checks for curation options, shared by the stage configs.

Each stage owns the rules for its options (``problems()`` on its config dataclass) and
``build_config`` runs them all before any stage does: a bad value would otherwise fail hours into a
run, after the stages before it, or be accepted and quietly change what a stage removes. A problem is
one sentence naming the dotted field, the value, what is allowed and what the option means.
"""

from __future__ import annotations

import math


def within(name: str, value: float, low: float, high: float = math.inf, meaning: str = "",
           low_open: bool = False) -> list[str]:
    """[] when ``value`` is finite and in [low, high] ((low, high] with ``low_open``), else the problem.

    NaN and infinity are refused too: NaN compares false with every bound, so a comparison alone
    would let it through to the stage, and an infinite weight or ratio is never what a user meant.
    """
    above = value > low if low_open else value >= low
    if math.isfinite(value) and above and value <= high:
        return []
    if not math.isfinite(value):
        allowed = "is not a finite number"
    elif high < math.inf:
        allowed = f"is outside {'(' if low_open else '['}{low}, {high}]"
    else:
        allowed = f"must be {'above' if low_open else 'at least'} {low}"
    return [f"{name}: {value} {allowed}" + (f"; {meaning}" if meaning else "")]
