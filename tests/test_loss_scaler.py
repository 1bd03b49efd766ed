"""The fp16 dynamic loss scaler's state machine."""

import pytest

from megazero.optim import ConstantLossScaler, DynamicLossScaler, LossScaleError
from megazero.optim.loss_scaler import scaler_change


def test_defaults_match_the_spec():
    s = DynamicLossScaler()
    assert (s.scale, s.window, s.hysteresis, s.min_scale) == (65536.0, 1000, 2, 1.0)


def test_window_of_clean_steps_doubles():
    s = DynamicLossScaler(initial_scale=8, window=3)
    for expected in (8, 8, 16, 16, 16, 32):
        s.update(False)
        assert s.scale == expected


def test_hysteresis_delays_the_first_halving_only():
    """As Megatron's and DeepSpeed's scalers: the overflows tolerated are spent until the scale grows, so
    a scale far too high falls a halving a step once they are (re-arming them at each halving took
    32 skipped steps from 2^32 to 2^16 at hysteresis 2, Megatron 17)."""
    s = DynamicLossScaler(initial_scale=64, window=100, hysteresis=2)
    s.update(True)
    assert s.scale == 64  # first overflow tolerated
    scales = []
    for _ in range(3):
        s.update(True)
        scales.append(s.scale)
    assert scales == [32, 16, 8]
    skipped, s = 0, DynamicLossScaler(initial_scale=2.0**32, window=1000, hysteresis=2)
    while s.scale > 2.0**16:
        s.update(True)
        skipped += 1
    assert skipped == 17


def test_clean_steps_reset_after_overflow():
    s = DynamicLossScaler(initial_scale=4, window=2, hysteresis=1)
    s.update(False)
    s.update(True)  # halves to 2, window count restarts
    s.update(False)
    assert s.scale == 2
    s.update(False)
    assert s.scale == 4


def test_overflow_at_minimum_is_a_clear_error():
    """Raised on every rank from the same flag, so it is agreed: rank 0 alone prints it."""
    s = DynamicLossScaler(initial_scale=2, window=100, hysteresis=1, min_scale=1)
    s.update(True)
    assert s.scale == 1
    with pytest.raises(LossScaleError, match="minimum loss scale 1") as raised:
        s.update(True)
    assert raised.value.agreed


def test_state_round_trip():
    s = DynamicLossScaler(initial_scale=16, window=5)
    for overflow in (False, True, False):
        s.update(overflow)
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()


def test_growth_rearms_the_hysteresis():
    """An overflow long ago must not count against the next one: after the scale grows, the next
    isolated overflow is tolerated again instead of halving at once (Megatron's scaler likewise)."""
    s = DynamicLossScaler(initial_scale=8, window=2, hysteresis=2)
    s.update(True)  # tolerated, one left
    s.update(False)
    s.update(False)
    assert s.scale == 16
    s.update(True)
    assert s.scale == 16


def test_halving_is_clamped_to_the_minimum():
    """A scale that is not a power of the factor lands on the minimum, not below it, and only an
    overflow there is the error."""
    s = DynamicLossScaler(initial_scale=12, window=100, hysteresis=1, min_scale=4)
    s.update(True)
    assert s.scale == 6
    s.update(True)
    assert s.scale == 4
    with pytest.raises(LossScaleError):
        s.update(True)


def test_the_engine_builds_the_scaler_from_every_precision_setting():
    """fp16 takes each ``precision`` setting in its place: a window passed as the hysteresis would let a
    thousand overflows go before the scale halved, and a minimum left at the default would let it fall
    below the configured floor instead of stopping the run. bf16 and fp32 train unscaled."""
    from megazero.config import load_config
    from megazero.engine import loss_scaler

    s = loss_scaler(load_config(None, ["--precision.dtype", "fp16", "--precision.initial_loss_scale", "1024",
                                       "--precision.loss_scale_window", "7", "--precision.hysteresis", "3",
                                       "--precision.min_loss_scale", "4"]))
    assert (s.scale, s.window, s.hysteresis, s.hysteresis_left, s.min_scale) == (1024.0, 7, 3, 3, 4.0)
    for dtype in ("bf16", "fp32"):
        assert loss_scaler(load_config(None, ["--precision.dtype", dtype])) is None


def test_a_resume_says_what_scaler_state_it_drops():
    """A converted model saves no scaler: in a bf16 or fp32 run that loses nothing and is not mentioned (it
    once printed "loss scaler None not carried over" on every rank); in an fp16 run the starting scale is
    named; a checkpoint of another precision names both scalers."""
    assert scaler_change("DynamicLossScaler", DynamicLossScaler()) is None
    assert scaler_change(None, ConstantLossScaler()) is None
    assert "starts at 1024" in scaler_change(None, DynamicLossScaler(initial_scale=1024))
    note = scaler_change("DynamicLossScaler", ConstantLossScaler())
    assert note.startswith("the checkpoint's DynamicLossScaler is not carried over to this run's ConstantLossScaler")
    assert "precision.dtype" in note
