"""A window of training steps under ``torch.profiler``, asked for in the config (``logging.profile_steps``).

Someone asking why a run is slower than it should be needs the host and the device on one time
line: which kernels ran, where the GPU sat idle, and what the host was doing meanwhile. The trainer
queues each step inside ``queueing`` and calls ``after_step`` once it has read that step's results;
the profiler runs from queueing the window's first step to reading its last, on the ranks asked
for, and each writes one Chrome-trace file (for Perfetto, chrome://tracing or
``benchmarks/trace_summary.py``), each step's host work under a ``megazero step N`` range. The
trainer queues steps ahead of the one it reads (``train.steps_ahead``), which would let the device
work of the step before the window and of the steps after it into the trace, and per-step figures
read from it would be off by that much; so on every rank it finishes the step before the window and
the window's last step before queueing the next (``pauses_after``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch


class StepProfiler:
    """Profiles steps ``steps[0]..steps[1]`` (inclusive) on the ranks in ``ranks``; a no-op elsewhere
    or when ``steps`` is None. A run resumed inside the window profiles the rest of it, and each trace
    is named after the steps it holds."""

    def __init__(self, steps: Optional[list[int]], ranks: list[int], rank: int, run_dir: str,
                 device: torch.device):
        self.bounds = (steps[0], steps[1]) if steps is not None else None  # on every rank, kept after close
        self.window = self.bounds if rank in ranks else None  # on profiled ranks, until the trace is written
        self.rank, self.device, self.run_dir = rank, device, run_dir
        self.path: Optional[str] = None  # the trace written, once it is
        self._profile = None
        self._traced: list[int] = []  # the first step profiled, then the last read

    def pauses_after(self, step: int) -> bool:
        """Whether ``step`` must finish before the next is queued, on every rank alike (the trainer's
        ranks agree on stopping once per round of queueing, so their rounds must match): the step
        before the window, so the trace starts on an idle device, and the window's last, so no later
        step's work enters it."""
        return self.bounds is not None and step in (self.bounds[0] - 1, self.bounds[1])

    def queueing(self, step: int):
        """Around the host's queueing of ``step``: starts the profiler if ``step`` lies in the window, and
        while profiling marks the queueing as a ``megazero step N`` range (nothing otherwise)."""
        if self.window is not None and self._profile is None and self.window[0] <= step <= self.window[1]:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._profile = profile(activities=activities)
            self._profile.start()
            self._traced = [step]
        if self._profile is None:
            return contextlib.nullcontext()
        return torch.profiler.record_function(f"megazero step {step}")

    def after_step(self, step: int) -> None:
        """``step``'s results have been read: after the window's last step, stop and write."""
        if self._profile is None:
            return
        self._traced[1:] = [step]
        if step >= self.window[1]:
            self.close()

    def __enter__(self) -> "StepProfiler":
        return self

    def __exit__(self, *exc) -> None:  # a run ended by an error still leaves its trace
        self.close()

    def close(self) -> None:
        """Stop and write the trace, also when the run ends inside the window; once a run."""
        if self._profile is None:
            return
        profile, self._profile, self.window = self._profile, None, None
        profile.stop()
        # named after the steps it holds: a run stopped inside the window and its resume write two
        # traces (one name for the window let the resume's replace the first part's)
        first, last = self._traced[0], self._traced[-1]
        self.path = os.path.join(self.run_dir, "profile", f"rank{self.rank}_steps{first}-{last}.json.gz")
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        partial = self.path.replace(".json.gz", f".partial{os.getpid()}.json.gz")  # the suffix picks gzip
        profile.export_chrome_trace(partial)
        os.replace(partial, self.path)  # a trace file is whole or absent
        print(f"megazero: rank {self.rank}: profile written to {self.path}", flush=True)
