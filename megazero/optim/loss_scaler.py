"""Loss scaling for fp16: keep small gradients representable without letting large ones overflow.

The dynamic scaler starts high (2^16), doubles after ``window`` clean steps in a row, and halves on
an overflowing step once ``hysteresis`` of them have been tolerated since it last grew (Megatron's
and DeepSpeed's rule: re-armed only by growth, so a scale far too high falls by one halving a step
once they are spent), and refuses to go below ``min_scale``: a run that overflows even
there is diverging, and continuing would only skip every step silently. Whether a step overflowed
is decided by the caller from an all-reduced flag, so every rank moves the scaler identically.
bf16 and fp32 use ``ConstantLossScaler`` (scale 1, never skips for scale reasons).
"""

from __future__ import annotations

from typing import Optional

from megazero.errors import UserError


class LossScaleError(UserError):
    """The loss scale fell to its minimum and gradients still overflow."""


class ConstantLossScaler:
    dynamic = False  # never needs to know whether a step overflowed

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def update(self, overflow: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]


class DynamicLossScaler:
    dynamic = True

    def __init__(self, initial_scale: float = 2.0**16, window: int = 1000, hysteresis: int = 2,
                 min_scale: float = 1.0, factor: float = 2.0):
        self.scale = float(initial_scale)
        self.window, self.hysteresis, self.min_scale, self.factor = window, hysteresis, min_scale, factor
        self.clean_steps = 0
        self.hysteresis_left = hysteresis

    def update(self, overflow: bool) -> None:
        """Advance the state machine after a step; ``overflow`` must agree on every rank."""
        if overflow:
            self.clean_steps = 0
            self.hysteresis_left = max(self.hysteresis_left - 1, 0)
            if self.hysteresis_left > 0:
                return
            if self.scale <= self.min_scale:  # every rank decides this from the same flag
                raise LossScaleError(
                    f"fp16 gradients overflow even at the minimum loss scale {self.min_scale:g}: the run is "
                    "diverging; lower optimizer.lr, use precision.dtype bf16, or resume from an earlier checkpoint",
                    agreed=True)
            self.scale = max(self.scale / self.factor, self.min_scale)
            return
        self.clean_steps += 1
        if self.clean_steps % self.window == 0:
            self.scale *= self.factor
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])


def scaler_change(saved_kind: Optional[str], scaler) -> Optional[str]:
    """What a resume should say about the loss scaler a checkpoint saved (``saved_kind``: its class name,
    None for a converted model, which saves none) when it is not ``scaler``'s kind; None when nothing
    is lost. A constant scale has no state, so a converted model loses nothing in a bf16 or fp32 run."""
    run_kind = type(scaler).__name__
    if saved_kind == run_kind or (saved_kind is None and not scaler.dynamic):
        return None
    if saved_kind is None:
        return ("the checkpoint holds no loss-scaler state (a converted model): the fp16 loss scale starts at "
                f"{scaler.scale:g}")
    return (f"the checkpoint's {saved_kind} is not carried over to this run's {run_kind} (precision.dtype changed); "
            "it starts afresh")
