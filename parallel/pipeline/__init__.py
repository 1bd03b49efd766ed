"""Pipeline parallelism: schedules as data, their point-to-point plan, and the executor that runs them."""

from parallel.pipeline.executor import PipelineExecutor, StepStats, default_forward_step
from parallel.pipeline.grads import allreduce_data_parallel_grads, sum_tied_grads
from parallel.pipeline.p2p import PipelineTimeout
from parallel.pipeline.plan import PipelineDeadlock, comm_plan, plan_for, simulate
from parallel.pipeline.schedule import SCHEDULES, Op, bubble_fraction, build_schedule, default_schedule

__all__ = [
    "SCHEDULES", "Op", "PipelineDeadlock", "PipelineExecutor", "PipelineTimeout", "StepStats",
    "allreduce_data_parallel_grads", "bubble_fraction", "build_schedule", "sum_tied_grads",
    "comm_plan", "default_forward_step", "default_schedule", "plan_for", "simulate",
]
