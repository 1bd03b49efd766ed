"""The blend's compiled index builder (the loop behind `megazero curate`'s blend.yaml and every
blended run) gives exactly the Python loop's output, and falls back to it, saying so in one line, without a working
C compiler."""

from __future__ import annotations

import numpy as np
import pytest

from data_pipeline import blend


@pytest.fixture
def fresh_helper(monkeypatch, tmp_path):
    """A clean cache directory and no remembered helper, so each test compiles (or fails to)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    blend.compiled_blend.cache_clear()
    yield
    blend.compiled_blend.cache_clear()


@pytest.mark.parametrize("seed", range(6))
def test_compiled_loop_matches_the_python_loop(fresh_helper, seed):
    if blend.compiled_blend() is None:
        pytest.skip("no working C compiler here")
    rng = np.random.default_rng(seed)
    weights = rng.random(int(rng.integers(1, 40)))
    weights[rng.random(len(weights)) < 0.2] = 0.0  # zero weights never win a tie against a positive one
    weights[0] += 1e-3
    if seed == 0:
        weights = np.array([1, 1, 1, 2, 2, 3], dtype=np.float64)  # exact ties on every round
    w = blend.normalise_weights(weights)
    ours = blend.greedy_blend(weights, 30_000)
    reference = blend.greedy_blend_python(w, 30_000)
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(ours, reference))


def test_without_a_compiler_the_python_loop_runs_and_says_so_once(fresh_helper, monkeypatch, capsys):
    monkeypatch.setenv("CC", "no-such-compiler-anywhere")
    d, s = blend.greedy_blend([0.25, 0.75], 8)
    assert d.tolist() == [1, 0, 1, 1, 0, 1, 1, 1] and s.tolist() == [0, 0, 1, 2, 1, 3, 4, 5]
    blend.greedy_blend([0.5, 0.5], 4)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err  # one line per process, however many blends it builds
    assert "no C compiler 'no-such-compiler-anywhere'" in err[0] and "30x slower" in err[0]


def test_a_failing_compiler_is_named_in_the_warning(fresh_helper, monkeypatch, capsys):
    monkeypatch.setenv("CC", "false")  # found on PATH, exits 1 without output
    assert blend.compiled_blend() is None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "failed" in err[0] and "false" in err[0] and "Python loop" in err[0]
