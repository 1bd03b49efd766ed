"""ZeRO data parallelism: sharded optimizer state, gradients and parameters over flat buckets."""

from megazero.zero.loss_scaler import ConstantLossScaler, DynamicLossScaler, LossScaleError
from megazero.zero.optimizer import STAGES, StepResult, ZeroOptimizer, ZeroSettings

__all__ = ["ConstantLossScaler", "DynamicLossScaler", "LossScaleError", "STAGES", "StepResult", "ZeroOptimizer",
           "ZeroSettings"]
