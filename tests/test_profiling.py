"""``logging.profile_steps`` on one rank without a trainer: which steps a trace holds, on which ranks,
and the name of the file it is written to (``megazero.profiling.StepProfiler``)."""

from __future__ import annotations

import gzip
import json
import os

import torch

from megazero.profiling import StepProfiler

CPU = torch.device("cpu")


def _steps_traced(profiler: StepProfiler, steps: range) -> list[str]:
    """Queue and read each of ``steps`` as the trainer does (a little host work in each), then the
    step ranges the written trace holds."""
    for step in steps:
        with profiler.queueing(step):
            torch.ones(4).add_(step)
        profiler.after_step(step)
    profiler.close()
    if profiler.path is None or not os.path.exists(profiler.path):
        return []
    with gzip.open(profiler.path, "rt") as f:
        names = [str(e.get("name")) for e in json.load(f)["traceEvents"] if e.get("cat") == "user_annotation"]
    return sorted(name for name in names if name.startswith("megazero step "))


def test_the_trace_holds_the_window_and_nothing_around_it(tmp_path):
    """A window of steps 2-3 in a run of 5: the trace starts at step 2's queueing and is written once
    step 3 is read, named after the rank and the window."""
    profiler = StepProfiler([2, 3], [1], 1, str(tmp_path), CPU)
    assert _steps_traced(profiler, range(1, 6)) == ["megazero step 2", "megazero step 3"]
    assert os.listdir(tmp_path / "profile") == ["rank1_steps2-3.json.gz"]


def test_a_one_step_window_and_a_resume_inside_a_window(tmp_path):
    """``[4, 4]`` profiles step 4 alone; a run stopped at step 2 of a 2-4 window writes step 2's
    trace, and its resume profiles the rest, in a file of its own (planted: both named after the
    window, so the resume's replaced the first part's)."""
    assert _steps_traced(StepProfiler([4, 4], [0], 0, str(tmp_path / "one"), CPU), range(1, 7)) == ["megazero step 4"]
    stopped = StepProfiler([2, 4], [0], 0, str(tmp_path / "run"), CPU)
    assert _steps_traced(stopped, range(1, 3)) == ["megazero step 2"]
    resumed = StepProfiler([2, 4], [0], 0, str(tmp_path / "run"), CPU)
    assert _steps_traced(resumed, range(3, 7)) == ["megazero step 3", "megazero step 4"]
    assert sorted(os.listdir(tmp_path / "run" / "profile")) == ["rank0_steps2-2.json.gz", "rank0_steps3-4.json.gz"]


def test_ranks_not_asked_for_write_nothing(tmp_path):
    """Only the ranks in ``logging.profile_ranks`` profile; the others still know the window (they
    pause with the profiled ranks)."""
    other = StepProfiler([2, 3], [1], 0, str(tmp_path), CPU)
    assert _steps_traced(other, range(1, 5)) == [] and not (tmp_path / "profile").exists()
    assert other.pauses_after(1) and other.pauses_after(3) and not other.pauses_after(2)
