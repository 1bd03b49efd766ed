"""Learning-rate and batch-size schedules against values worked out by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megazero.config.schema import OptimizerConfig, ScheduleConfig, TrainConfig
from megazero.errors import ConfigError
from megazero.training_schedules import BatchSchedule, build_batch_schedule, build_lr_schedule

TOL = 1e-12  # the schedule is closed-form arithmetic; only float rounding separates it from the hand value


def lr_schedule(style="cosine", warmup=10, decay=100, train_steps=1000, lr=1.0e-3, min_lr=1.0e-4):
    return build_lr_schedule(OptimizerConfig(lr=lr, min_lr=min_lr),
                             ScheduleConfig(warmup_steps=warmup, decay_steps=decay, decay_style=style),
                             TrainConfig(train_steps=train_steps))


def test_warmup_is_linear_from_the_first_update():
    lr = lr_schedule()
    assert lr(1) == pytest.approx(1.0e-4, abs=TOL)
    assert lr(5) == pytest.approx(5.0e-4, abs=TOL)


def test_warmup_ends_at_the_peak():
    assert lr_schedule()(10) == pytest.approx(1.0e-3, abs=TOL)


def test_cosine_mid_decay_is_halfway_between_peak_and_floor():
    # step 60 = warm-up 10 + half of decay 100: cos(pi/2) = 0 -> (peak + floor) / 2
    assert lr_schedule()(60) == pytest.approx(5.5e-4, abs=TOL)


def test_cosine_quarter_decay():
    # progress 1/4: floor + (peak - floor) * (1 + cos(pi/4)) / 2
    expected = 1.0e-4 + 9.0e-4 * (1 + math.sqrt(0.5)) / 2
    assert lr_schedule()(35) == pytest.approx(expected, abs=TOL)


def test_decay_reaches_the_floor_and_stays():
    lr = lr_schedule()
    assert lr(110) == pytest.approx(1.0e-4, abs=TOL)
    assert lr(111) == pytest.approx(1.0e-4, abs=TOL)
    assert lr(10_000) == pytest.approx(1.0e-4, abs=TOL)


def test_linear_decay():
    lr = lr_schedule(style="linear")
    assert lr(35) == pytest.approx(1.0e-4 + 9.0e-4 * 0.75, abs=TOL)
    assert lr(60) == pytest.approx(5.5e-4, abs=TOL)
    assert lr(110) == pytest.approx(1.0e-4, abs=TOL)


def test_constant_stays_at_peak_after_warmup():
    lr = lr_schedule(style="constant", decay=None, train_steps=None)
    assert lr(5) == pytest.approx(5.0e-4, abs=TOL)
    assert lr(10) == lr(500) == pytest.approx(1.0e-3, abs=TOL)


def test_decay_defaults_to_the_rest_of_training():
    lr = lr_schedule(warmup=10, decay=None, train_steps=210)  # 200 decay steps
    assert lr(110) == pytest.approx(5.5e-4, abs=TOL)
    assert lr(210) == pytest.approx(1.0e-4, abs=TOL)


def test_no_warmup_starts_at_peak():
    assert lr_schedule(warmup=0)(1) == pytest.approx(1.0e-4 + 9.0e-4 * (1 + math.cos(math.pi / 100)) / 2, abs=TOL)


def test_zero_decay_steps_drops_to_the_floor_after_warmup():
    lr = lr_schedule(decay=0)
    assert lr(10) == pytest.approx(1.0e-3, abs=TOL)
    assert lr(11) == pytest.approx(1.0e-4, abs=TOL)


def test_step_is_one_based():
    with pytest.raises(ValueError, match="1-based"):
        lr_schedule()(0)


def test_token_limited_run_needs_decay_steps():
    with pytest.raises(ConfigError, match="schedule.decay_steps"):
        lr_schedule(decay=None, train_steps=None)


@pytest.mark.parametrize("style", ["cosin", "Linear"])
def test_an_unknown_decay_style_is_refused_not_run_as_cosine(style):
    with pytest.raises(ConfigError, match="schedule.decay_style"):
        lr_schedule(style=style)


# --- batch-size ramp-up -------------------------------------------------------------------------

MTNLG_RAMP_SAMPLES = 12_000_000_000 // 2048  # 12B tokens of 2048-token samples = 5,859,375 samples


def mtnlg(micro=1, dp=8):
    return build_batch_schedule(ScheduleConfig(rampup_start_batch=32, rampup_increment=32,
                                               rampup_samples=MTNLG_RAMP_SAMPLES),
                                TrainConfig(micro_batch_size=micro, global_batch_size=1920), dp)


def test_mtnlg_ramp_starts_at_32():
    assert mtnlg().global_batch(0) == 32


def test_mtnlg_ramp_increments_at_stretch_boundaries():
    # (1920 - 32) / 32 = 59 increments, one per 5,859,375 / 59 = 99,311.44 samples
    ramp = mtnlg()
    assert ramp.global_batch(99_311) == 32
    assert ramp.global_batch(99_312) == 64
    assert ramp.global_batch(2 * 99_312) == 96
    assert ramp.global_batch(MTNLG_RAMP_SAMPLES - 1) == 32 + 58 * 32


def test_mtnlg_ramp_reaches_full_size():
    ramp = mtnlg()
    assert ramp.global_batch(MTNLG_RAMP_SAMPLES) == 1920
    assert ramp.global_batch(10**12) == 1920


def test_mtnlg_config_schedule_spans_the_papers_tokens_through_the_ramp():
    """MT-NLG warms up over 1B tokens and decays to 10% over 340B; the schedule counts steps, and the
    ramp's steps are smaller than full ones, so the config's step counts must be walked through it."""
    from megazero.config import load_config

    cfg = load_config("configs/mtnlg_530b.yaml", [])
    ramp = build_batch_schedule(cfg.schedule, cfg.train, dp=8)
    s, seq, full = cfg.schedule, cfg.model.seq_length, cfg.train.global_batch_size

    def tokens_after(steps):
        consumed = 0
        for _ in range(steps):
            consumed += ramp.global_batch(consumed)
        return consumed * seq

    assert 0 <= tokens_after(s.warmup_steps) - 10**9 < full * seq
    assert 0 <= tokens_after(s.warmup_steps + s.decay_steps) - 340 * 10**9 < full * seq


def test_ramp_is_monotone_and_always_a_multiple_of_micro_times_dp():
    ramp = mtnlg(micro=2, dp=24)  # unit 48: 32 -> 48, 64 -> 48, 96 -> 96, ...
    sizes = [ramp.global_batch(s) for s in range(0, MTNLG_RAMP_SAMPLES + 50_000, 50_000)]
    assert all(size % 48 == 0 for size in sizes)
    assert sizes == sorted(sizes)
    assert sizes[0] == 48 and sizes[-1] == 1920


def test_ramp_rounds_down_to_whole_micro_batches():
    ramp = BatchSchedule(full=1920, unit=64, start=32, increment=32, rampup_samples=59_000)
    assert [ramp.global_batch(s) for s in (0, 1_000, 2_000, 3_000, 4_000)] == [64, 64, 64, 128, 128]
    assert ramp.micro_batches(3_000) == 2


def test_partial_last_increment_ends_at_full():
    # (100 - 10) / 20 -> 5 increments, the last one only 10 wide
    ramp = BatchSchedule(full=100, unit=10, start=10, increment=20, rampup_samples=500)
    assert [ramp.global_batch(s) for s in (0, 100, 200, 300, 400, 499, 500)] == [10, 30, 50, 70, 90, 90, 100]


def test_sizes_list_every_size_the_ramp_takes_and_no_other():
    """``sizes`` against the sizes ``global_batch`` gives at every sample count of the ramp: an
    increment wider than the unit (the partial last one included), one narrower (every multiple of the
    unit reached), and a ramp that starts below one unit."""
    for ramp in (BatchSchedule(full=100, unit=10, start=10, increment=20, rampup_samples=500),
                 BatchSchedule(full=1920, unit=48, start=32, increment=32, rampup_samples=59_000),
                 BatchSchedule(full=64, unit=16, start=3, increment=5, rampup_samples=1_000)):
        taken = {ramp.global_batch(s) for s in range(ramp.rampup_samples + 1)}
        assert ramp.sizes() == sorted(taken), ramp
    assert BatchSchedule(full=32, unit=8).sizes() == [32]


def test_no_rampup_is_the_full_batch():
    ramp = build_batch_schedule(ScheduleConfig(), TrainConfig(micro_batch_size=4, global_batch_size=32), dp=2)
    assert ramp.global_batch(0) == 32
    assert ramp.micro_batches(0) == 4


def test_ramp_start_above_full_is_rejected():
    with pytest.raises(ConfigError, match="schedule.rampup_start_batch"):
        build_batch_schedule(ScheduleConfig(rampup_start_batch=64, rampup_samples=10),
                             TrainConfig(micro_batch_size=1, global_batch_size=32), dp=1)


def test_full_batch_must_split_into_micro_batches():
    with pytest.raises(ConfigError, match="train.global_batch_size"):
        build_batch_schedule(ScheduleConfig(), TrainConfig(micro_batch_size=4, global_batch_size=36), dp=2)


def test_ramp_start_equal_to_full_is_accepted():
    # only a start *above* the full batch is refused: equal means the batch is full from the first step
    ramp = build_batch_schedule(ScheduleConfig(rampup_start_batch=32, rampup_samples=10),
                                TrainConfig(micro_batch_size=1, global_batch_size=32), dp=1)
    assert [ramp.global_batch(s) for s in (0, 9, 10)] == [32, 32, 32]


@pytest.mark.parametrize("samples", [0, -5])
def test_ramp_over_no_samples_is_rejected(samples):
    # a start batch with rampup_samples 0 would be ignored silently (the batch is full at sample 0)
    with pytest.raises(ConfigError, match="schedule.rampup_samples"):
        build_batch_schedule(ScheduleConfig(rampup_start_batch=8, rampup_samples=samples),
                             TrainConfig(micro_batch_size=1, global_batch_size=32), dp=1)


@pytest.mark.parametrize("increment", [0, -32])
def test_ramp_without_a_positive_increment_is_rejected(increment):
    # an increment of 0 would divide by zero at the first step instead of naming the field
    with pytest.raises(ConfigError, match="schedule.rampup_increment"):
        build_batch_schedule(ScheduleConfig(rampup_start_batch=8, rampup_increment=increment, rampup_samples=100),
                             TrainConfig(micro_batch_size=1, global_batch_size=32), dp=1)


def test_ramp_takes_its_configured_increment():
    # 16 -> 64 by 16: three increments, so a third of the way the batch is 32 (by the default 32: 16)
    ramp = build_batch_schedule(ScheduleConfig(rampup_start_batch=16, rampup_increment=16, rampup_samples=300),
                                TrainConfig(micro_batch_size=1, global_batch_size=64), dp=1)
    assert [ramp.global_batch(s) for s in (0, 99, 100, 200, 300)] == [16, 16, 32, 48, 64]


def test_ramp_samples_without_a_start_batch_is_no_ramp():
    ramp = build_batch_schedule(ScheduleConfig(rampup_samples=100),
                                TrainConfig(micro_batch_size=1, global_batch_size=32), dp=1)
    assert [ramp.global_batch(s) for s in (0, 50, 100)] == [32, 32, 32]


def test_a_stretch_holds_one_batch_size_to_its_end():
    """``stretch_end`` is where the batch may next change: the size is the same up to it, and the next
    stretch starts there; past the ramp, and for a ramp that starts full, it is the ramp's end."""
    ramp = BatchSchedule(full=1920, unit=16, start=32, increment=32, rampup_samples=5000)
    for consumed in (0, 1, 83, 84, 85, 2500, 4999):
        end = ramp.stretch_end(consumed)
        assert consumed < end <= 5000
        assert {ramp.global_batch(c) for c in range(consumed, end)} == {ramp.global_batch(consumed)}
        assert end == 5000 or ramp.global_batch(end) != ramp.global_batch(consumed) or ramp._stretch(end) > \
            ramp._stretch(consumed)
    assert ramp.stretch_end(6000) == 5000
    assert BatchSchedule(full=64, unit=8, start=64, increment=8, rampup_samples=100).stretch_end(3) == 100


def test_a_resumes_batch_comparison_jumps_over_each_stretch(monkeypatch):
    """A resume compares the batch sizes ahead of the checkpoint through the ramp; stepping one batch at
    a time took a minute at every launch of a ramp over 1e8 samples. It looks once a stretch now and
    finds the same first difference. (Planted: a step at a time, 25 million looks here.)"""
    from megazero.config import Config
    from megazero.resume_checks import batch_changes

    def config(dp: int, start: int) -> Config:
        base = Config()
        return dataclasses.replace(
            base, parallel=dataclasses.replace(base.parallel, dp=dp),
            train=dataclasses.replace(base.train, global_batch_size=64, micro_batch_size=2),
            schedule=dataclasses.replace(base.schedule, rampup_start_batch=start, rampup_increment=start,
                                         rampup_samples=10**8))

    looks = []
    global_batch = BatchSchedule.global_batch
    monkeypatch.setattr(BatchSchedule, "global_batch", lambda self, c: looks.append(c) or global_batch(self, c))
    assert batch_changes(config(1, 4), config(2, 4), 0) == []  # every size a multiple of 4: dp 2 changes none
    assert len(looks) < 100, len(looks)
    assert batch_changes(config(1, 2), config(2, 2), 0)[0].startswith(
        "would train the step at sample 0 on a global batch of 4 instead of 2")
