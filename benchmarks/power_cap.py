"""What a fair speed comparison on a power-capped GPU needs: runs that train alike, and each run's clock.

A busy H100 or H200 SXM sits on its power cap (700 W) and the driver lowers the SM clock until the
board fits under it, so a step's speed follows the energy the step costs, and that depends on more
than the code. The same GPT 1.3B through the same trainer ran 1.6% faster at the peers' constant
learning rate than in the first steps of the config's warm-up, at a 2.4% higher clock
(``BENCHMARKS.md``): a step costs more energy while the weights barely move (which property of the
GEMMs' operands does it was not isolated; random tokens against text made no difference). So
megazero's benchmarks train at the peers' learning rate (``PEER_OPTIMIZER``), and ``ClockSampler``
records the SM clock and board power while a run works, so that a comparison made at different
clocks shows.

    with ClockSampler() as clock:
        run_the_benchmark()
    print(clock.summary())  # {"sm_MHz": 1605.0, "power_W": 691.8, "power_capped": 0.96, "temp_C": 52.0, ...}
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
from typing import Iterable, Optional

# the peers' learning rate (benchmarks/peers/: fused AdamW at 1e-4, constant; betas and decay are megazero's
# defaults already). megazero still clips gradients at 1.0, which the peers do not: work only it does.
PEER_OPTIMIZER = ["--optimizer.lr", "1e-4", "--schedule.warmup_steps", "0", "--schedule.decay_style", "constant"]
QUERY = "clocks.sm,power.draw,utilization.gpu,clocks_throttle_reasons.active,temperature.gpu"
SW_POWER_CAP = 0x4  # the throttle-reason bit nvidia-smi sets while the driver holds the board to its power limit
BUSY_PERCENT = 90  # samples below this utilization are start-up or compilation, not steps


def visible_gpu(local_index: int = 0) -> str:
    """The index (or UUID) ``nvidia-smi`` knows CUDA device ``local_index`` of this process by: that
    entry of ``CUDA_VISIBLE_DEVICES`` when it is set, since nvidia-smi itself ignores the variable."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[local_index] if local_index < len(visible) else str(local_index)


def summarize(lines: Iterable[str]) -> dict[str, Optional[float]]:
    """Median SM clock (MHz), power (W) and temperature (C) over the busy samples of ``nvidia-smi
    --format=csv,noheader,nounits`` lines of ``QUERY``, the fraction of those held at the power cap,
    and their number; None where no sample was busy (a window too short, or nvidia-smi reading another
    GPU than CUDA's). The temperature because a hotter chip leaks more, so at the same power cap it
    clocks lower (two one-GPU trainings side by side on two H200s, though, ran within 0.3% of one
    alone: BENCHMARKS.md)."""
    busy = []
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        try:
            clock, power, util, reasons = float(fields[0]), float(fields[1]), float(fields[2]), int(fields[3], 16)
            temperature = float(fields[4])
        except (IndexError, ValueError):  # a "[N/A]" field, or a line cut short when the sampler stopped
            continue
        if util >= BUSY_PERCENT:
            busy.append((clock, power, bool(reasons & SW_POWER_CAP), temperature))
    if not busy:
        return {"sm_MHz": None, "power_W": None, "power_capped": None, "temp_C": None, "clock_samples": 0}
    return {"sm_MHz": statistics.median(b[0] for b in busy), "power_W": round(statistics.median(b[1] for b in busy), 1),
            "power_capped": round(sum(b[2] for b in busy) / len(busy), 2),
            "temp_C": statistics.median(b[3] for b in busy), "clock_samples": len(busy)}


class ClockSampler:
    """Samples one GPU (``nvidia-smi``'s index; default this process's first) every ``interval_ms`` while
    the ``with`` block runs; ``summary()`` after it. Without ``nvidia-smi`` the summary's fields are None."""

    def __init__(self, gpu: Optional[str] = None, interval_ms: int = 100):
        self.gpu, self.interval_ms = gpu if gpu is not None else visible_gpu(), interval_ms
        self._proc: Optional[subprocess.Popen] = None
        self._lines: list[str] = []

    def __enter__(self) -> "ClockSampler":
        if shutil.which("nvidia-smi"):
            # a file, not a pipe: nobody reads while the benchmark runs, and a full pipe would stall the sampler
            self._log = tempfile.TemporaryFile(mode="w+")
            self._proc = subprocess.Popen(
                ["nvidia-smi", "-i", self.gpu, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                 "-lms", str(self.interval_ms)], stdout=self._log, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._log.seek(0)
            self._lines = self._log.read().splitlines()
            self._log.close()

    def summary(self) -> dict[str, Optional[float]]:
        return summarize(self._lines)
