"""Learning-rate and batch-size schedules as pure functions of training progress.

Nothing here holds state: the learning rate is a function of the optimizer step and the global batch
size a function of the samples consumed so far. A resumed run therefore needs no scheduler state
beyond the step and consumed-sample counters it restores anyway, and every rank computes the same
values without communicating.

Step convention: ``step`` is the 1-based number of the optimizer update about to be applied (the
first update is step 1), i.e. ``completed_steps + 1``. With ``warmup_steps = W`` the first update
already uses ``lr / W`` rather than wasting a step at zero, update ``W`` uses the peak ``lr``, and
update ``W + decay_steps`` reaches ``min_lr``, which then holds to the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from megazero.errors import ConfigError

if TYPE_CHECKING:  # annotations only: the config package validates with these schedules
    from megazero.config.schema import OptimizerConfig, ScheduleConfig, TrainConfig

DECAY_STYLES = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class LRSchedule:
    """Linear warm-up to ``peak``, then cosine/linear decay to ``floor`` (or constant at ``peak``)."""

    peak: float
    floor: float
    warmup_steps: int
    decay_steps: int
    style: str = "cosine"

    def __call__(self, step: int) -> float:
        if step < 1:
            raise ValueError(f"learning-rate step is 1-based (the update being applied); got {step}")
        if step <= self.warmup_steps:
            return self.peak * step / self.warmup_steps
        if self.style == "constant":
            return self.peak
        if self.decay_steps == 0:
            return self.floor
        progress = min((step - self.warmup_steps) / self.decay_steps, 1.0)
        if self.style == "linear":
            weight = 1.0 - progress
        else:
            weight = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.floor + (self.peak - self.floor) * weight


def build_lr_schedule(optimizer: OptimizerConfig, schedule: ScheduleConfig, train: TrainConfig) -> LRSchedule:
    """The run's schedule; decay spans ``schedule.decay_steps`` or else the steps left after warm-up."""
    if schedule.decay_style not in DECAY_STYLES:
        raise ConfigError(f"schedule.decay_style: {schedule.decay_style!r} is not one of {', '.join(DECAY_STYLES)}")
    decay = schedule.decay_steps
    if decay is None and schedule.decay_style != "constant":
        if train.train_steps is None:
            raise ConfigError("schedule.decay_steps: must be set when train.train_steps is null (a token or "
                              "wall-clock limit gives no step count to decay over)")
        decay = max(train.train_steps - schedule.warmup_steps, 0)
    return LRSchedule(peak=optimizer.lr, floor=optimizer.min_lr, warmup_steps=schedule.warmup_steps,
                      decay_steps=decay or 0, style=schedule.decay_style)


@dataclass(frozen=True)
class BatchSchedule:
    """Global batch size as a function of consumed samples, ramping up from ``start`` to ``full``.

    The ramp-up (MT-NLG: 32 -> 1920 in increments of 32 over the first 12B tokens) splits
    ``rampup_samples`` into equal stretches, one per increment; during stretch ``k`` the nominal batch
    is ``start + k * increment``. A step must hand every data-parallel rank a whole number of
    micro-batches, so the nominal size is rounded *down* to a multiple of ``unit = micro_batch * dp``,
    but never below one ``unit`` (so with a large dp the ramp may begin above ``start``, and sizes
    between two multiples repeat). Once ``rampup_samples`` have been consumed the batch is ``full``,
    which validation already requires to be a multiple of ``unit``. Integer arithmetic only, so the
    size at a given sample count is the same on every rank and on every resume.
    """

    full: int
    unit: int
    start: Optional[int] = None
    increment: int = 32
    rampup_samples: int = 0

    def global_batch(self, consumed_samples: int) -> int:
        if self.start is None or consumed_samples >= self.rampup_samples:
            return self.full
        nominal = min(self.start + self._stretch(consumed_samples) * self.increment, self.full)
        return max(self.unit, nominal // self.unit * self.unit)

    def stretch_end(self, consumed_samples: int) -> int:
        """The sample count where the ramp's stretch holding ``consumed_samples`` ends: the batch is
        the same up to there (``rampup_samples`` past the ramp)."""
        if self.start is None or consumed_samples >= self.rampup_samples or not self._increments():
            return self.rampup_samples  # past the ramp, or a ramp that starts full: one stretch
        return -(-(self._stretch(consumed_samples) + 1) * self.rampup_samples // self._increments())

    def _increments(self) -> int:
        return -(-(self.full - self.start) // self.increment)  # the last one may be partial

    def _stretch(self, consumed_samples: int) -> int:
        return consumed_samples * self._increments() // self.rampup_samples

    def micro_batches(self, consumed_samples: int) -> int:
        """Micro-batches each data-parallel rank accumulates in the step starting at this sample count."""
        return self.global_batch(consumed_samples) // self.unit

    def sizes(self) -> list[int]:
        """Every global batch size the schedule names, smallest first, the full one included: under a
        ramp-up each stretch's (a stretch too short for one step is still listed, so this can name a
        size the run skips, never miss one it takes). At most ``full // unit`` sizes: where the
        increment is below ``unit`` every multiple of ``unit`` from the first size on is reached."""
        if self.start is None:
            return [self.full]
        if self.increment >= self.unit:
            nominal = range(self.start, self.full, self.increment)
        else:
            nominal = range(self.start // self.unit * self.unit, self.full, self.unit)
        return sorted({max(self.unit, n // self.unit * self.unit) for n in nominal} | {self.full})

    def micro_batch_counts(self) -> list[int]:
        """Micro-batches a data-parallel rank accumulates in a step of each of ``sizes``, fewest first."""
        return [size // self.unit for size in self.sizes()]


def build_batch_schedule(schedule: ScheduleConfig, train: TrainConfig, dp: int) -> BatchSchedule:
    """The run's batch schedule for ``dp`` data-parallel ranks; rejects a ramp that cannot work."""
    unit = train.micro_batch_size * dp
    if train.global_batch_size % unit:
        raise ConfigError(f"train.global_batch_size: {train.global_batch_size} is not a multiple of "
                          f"train.micro_batch_size*dp = {unit}")
    start = schedule.rampup_start_batch
    if start is not None:
        if start > train.global_batch_size:
            raise ConfigError(f"schedule.rampup_start_batch: {start} exceeds train.global_batch_size "
                              f"{train.global_batch_size}; lower it or set it null to disable ramp-up")
        if schedule.rampup_increment <= 0:
            raise ConfigError(f"schedule.rampup_increment: must be positive, got {schedule.rampup_increment}")
        if schedule.rampup_samples <= 0:  # the batch would be full from the first step, the start ignored
            raise ConfigError(f"schedule.rampup_samples: is {schedule.rampup_samples}, so schedule.rampup_start_batch "
                              f"{start} ramps nothing up; set rampup_samples (the samples over which the batch grows "
                              "to train.global_batch_size) or rampup_start_batch null")
    return BatchSchedule(full=train.global_batch_size, unit=unit, start=start,
                         increment=schedule.rampup_increment, rampup_samples=schedule.rampup_samples)
