"""The planner: per-GPU memory and step time of a 3D layout, and the search over layouts
(``megazero plan``; the start-up memory check in ``megazero.preflight``)."""

from megazero.planner.hardware import GPUS, Cluster, GPU, custom_gpu
from megazero.planner.memory import MemoryEstimate, estimate_memory, max_model_params
from megazero.planner.search import Candidate, Layout, evaluate, layout_of, nearest_fitting, plan
from megazero.planner.time import StepEstimate, estimate_step

__all__ = ["GPUS", "Candidate", "Cluster", "GPU", "Layout", "MemoryEstimate", "StepEstimate", "custom_gpu",
           "estimate_memory", "estimate_step", "evaluate", "layout_of", "max_model_params", "nearest_fitting", "plan"]
