"""The planner: per-GPU memory and step time of a 3D layout, and the search over layouts
(``megazero plan``; the start-up memory check in ``megazero.preflight``).

Each name loads with its module on first use: every ``megazero`` command builds ``plan``'s parser,
which lists the GPU presets (``hardware``, plain data), and the data commands would otherwise pay
for the time and memory models' imports (the config, the model and torch: about 2 s) on every call.
"""

import importlib

_HOMES = {"GPUS": "hardware", "Cluster": "hardware", "GPU": "hardware", "custom_gpu": "hardware",
          "MemoryEstimate": "memory", "estimate_memory": "memory", "max_model_params": "memory",
          "Candidate": "search", "Layout": "search", "evaluate": "search", "layout_of": "search",
          "nearest_fitting": "search", "plan": "search", "StepEstimate": "time", "estimate_step": "time"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
