"""What a resume would change, compared between the config a checkpoint records and the run's own
(``megazero.resume_checks``), on configs alone: no data, checkpoint or process group."""

from __future__ import annotations

import pytest

from megazero.config import load_config
from megazero.config.loader import config_to_dict
from megazero.resume_checks import _resume_changes
from megazero.training_schedules import build_lr_schedule


def _config(*extra):
    return load_config(None, ["--train.train_steps", "10", "--schedule.warmup_steps", "2", "--train.device", "cpu",
                              *extra])


def test_the_learning_rate_compared_is_that_of_the_next_step_under_both_configs():
    """A checkpoint of step 4, mid-decay, resumed with its own config continues its schedule; a longer
    run would change the rate of step 5, which is what the message gives. (Planted: the checkpoint's
    rate taken at its own step, which refused every unchanged resume mid-decay; the launch tests'
    checkpoints sat where the rate was flat, so none saw it.)"""
    saved = _config()
    assert _resume_changes(config_to_dict(saved), saved, 4, 16) == []
    longer = _config("--train.train_steps", "20")
    (problem,) = _resume_changes(config_to_dict(saved), longer, 4, 16)
    was, will = (build_lr_schedule(c.optimizer, c.schedule, c.train)(5) for c in (saved, longer))
    assert was != pytest.approx(will)
    assert problem.startswith(f"would change the learning rate of step 5 from {was:.4g} to {will:.4g} "
                              "(train.train_steps changed"), problem


def test_a_learning_rate_a_few_percent_off_is_a_change():
    """Only rounding is forgiven: a peak rate 5% higher changes every step ahead, and is named."""
    saved = _config()
    nudged = _config("--optimizer.lr", repr(saved.optimizer.lr * 1.05))
    (problem,) = _resume_changes(config_to_dict(saved), nudged, 4, 16)
    assert problem.startswith("would change the learning rate of step 5") and "(optimizer.lr changed)" in problem
