"""Config values past any use: refused by name in one line, and shown cut."""

import pytest

from megazero.config import Config, load_config, validate_config
from megazero.config.loader import build_dataclass
from megazero.errors import ConfigError


@pytest.mark.parametrize("override, said", [
    (["--optimizer.lr", "1" + "0" * 400], "optimizer.lr: expected a number within a float's range, got 1000"),
    (["--train.train_steps", "1" + "0" * 400], "train.train_steps: 1000"),
    (["--model.num_layers", "1e29"], "model.num_layers: 100000000000000000000000000000 is more than 10,000"),
    (["--model.hidden_size", "1e29"], "model.hidden_size: 100000000000000000000000000000 is more than 1,048,576"),
    (["--model.rope_theta", "1e-320"], "model.rope_theta: 9.99989e-321 must be more than 1"),
    # finite, but its bytes overflowed to infinity: --check passed and the engine's start raised
    (["--zero.bucket_size_mb", "1e303"], "zero.bucket_size_mb: 1e+303 is more than 1.09951e+12 MiB"),
])
def test_values_past_any_use_are_refused_by_name(override, said):
    """Values of hundreds of digits, or sizes far past any model: a float field raised OverflowError, a
    count overflowed the checks' division, 1e29 layers hung the planner's estimate, and a width of
    1e29 passed the checks and failed allocating. (Planted: no bounds.)"""
    with pytest.raises(ConfigError) as refused:
        validate_config(load_config(None, override))
    [line] = str(refused.value).splitlines()
    assert line.startswith(said) and len(line) < 600, line


def test_a_huge_refused_value_is_shown_cut():
    """A YAML alias tree of a few hundred bytes spells out to gigabytes: the one-line error printed it
    whole (522 MB for 10^8 leaves). (Planted: the value's whole repr.)"""
    tree = ["x"]
    for _ in range(7):
        tree = [tree] * 10
    with pytest.raises(ConfigError) as refused:
        build_dataclass(Config, {"train": {"seed": tree}}, prefix="")
    message = str(refused.value)
    assert message.startswith("train.seed: expected an integer, got [[[") and message.endswith("(cut)")
    assert len(message) < 300, len(message)
