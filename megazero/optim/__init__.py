"""The sharded optimizer: AdamW over the shard the data-parallel wrapper describes, loss scaling,
ZeRO-Offload's host update, and the ZeRO memory formula."""

from megazero.optim.loss_scaler import ConstantLossScaler, DynamicLossScaler, LossScaleError
from megazero.optim.sharded_adamw import STATE_KEYS, AdamWSettings, ShardedAdamW, StepResult, shard_description

__all__ = ["STATE_KEYS", "AdamWSettings", "ConstantLossScaler", "DynamicLossScaler", "LossScaleError",
           "ShardedAdamW", "StepResult", "shard_description"]
