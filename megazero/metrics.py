"""What a run reports while it trains: a line per log interval, a JSON object per step, a progress bar.

``MetricsLogger`` is the single sink the trainer calls once per optimizer step. Only the writer rank
(global rank 0 by convention) prints and writes; the others construct it with ``writer=False`` so
the trainer's code path is the same on every rank. Outputs:

* stdout, every ``log_interval`` steps: averages over the interval (loss over finite losses,
  throughput over the interval's wall time) plus the latest lr, grad norm, loss scale and memory;
* ``RUN_DIR/metrics.jsonl``: one object per step (fields in docs/metrics.md). Floats are written
  with ``repr`` precision -- the shortest text that reads back as the same double -- so two runs
  whose losses are bitwise equal have equal lines, and any difference shows. Non-finite values
  (a skipped NaN step) are written as ``null``;
* a tqdm bar over the run's steps (hidden when stdout is not a terminal);
* optionally wandb and TensorBoard, imported only when enabled.

The file is only ever appended to, never rewritten: it is the record of everything a run did,
including steps that a crash threw away. A resumed run first ends a torn last line (a kill -9 in
the middle of a write), then appends a marker ``{"event": "resume", "step": k, ...}``; the steps
after ``k`` written before the marker were recomputed, so ``read_metrics`` lets the rows after a
marker supersede them and returns one row per step. A line that is not JSON is skipped with a
warning naming the file and line, never an error that blocks a resume.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TextIO

from megazero.errors import UserError

METRICS_FILE = "metrics.jsonl"
WANDB_MODES = ("offline", "online")  # logging.wandb_mode, passed to wandb.init
MAX_EXP = math.log(sys.float_info.max)  # 709.78: the largest loss whose perplexity a float holds


@dataclass
class StepMetrics:
    """One optimizer step as the trainer measured it.

    ``tokens`` are the tokens of this step's global batch (all dp ranks), ``seconds`` its wall time;
    ``loss`` is the mean loss over the global batch. ``val_loss`` is set on evaluation steps.
    """

    step: int
    loss: float
    lr: float
    grad_norm: Optional[float]
    tokens: int
    seconds: float
    loss_scale: float = 1.0
    skipped_steps: int = 0
    consumed_samples: Optional[int] = None
    val_loss: Optional[float] = None
    host_wait_s: Optional[float] = None  # how long the host waited for this step's results


def memory_gib(device) -> dict[str, float]:
    """Accelerator memory in GiB on CUDA (allocated now, peak allocated, and peak reserved: the memory
    pools of CUDA-graph blocks, which replays use without allocating, count only there); peak RSS of
    this process on CPU."""
    import torch

    if device.type == "cuda":
        return {"mem_gib": torch.cuda.memory_allocated(device) / 2**30,
                "mem_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "mem_reserved_peak_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    try:
        import resource
    except ImportError:  # not on POSIX: no cheap way to ask
        return {}
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return {"rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30}


def _finite(value: Optional[float]) -> Optional[float]:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class MetricsLogger:
    """Formats, prints and stores per-step metrics; see the module docstring for what goes where.

    ``flops_per_token`` is the *model* FLOPs per token (``megazero.flops.flops_per_token`` with no
    recompute); ``num_devices`` the ranks sharing the work (the world size); ``peak_flops`` one
    device's dense peak FLOP/s for the run's dtype, or None where unknown, which makes MFU None.
    ``start_step`` is the last completed step (0 for a fresh run, the checkpoint's step on resume).
    """

    def __init__(self, run_dir: str | os.PathLike, *, total_steps: Optional[int], log_interval: int,
                 flops_per_token: int, num_devices: int, peak_flops: Optional[float], start_step: int = 0,
                 writer: bool = True, progress_bar: bool = True, stream: Optional[TextIO] = None,
                 wandb: Optional[dict] = None, tensorboard: bool = False, device=None):
        self.path = Path(run_dir) / METRICS_FILE
        self.log_interval = log_interval
        self.flops_per_token, self.num_devices, self.peak_flops = flops_per_token, num_devices, peak_flops
        self.writer, self.device = writer, device
        self.stream = stream if stream is not None else sys.stdout
        self._interval: list[StepMetrics] = []
        self._file = self._bar = self._wandb = self._tensorboard = None
        if not writer:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open_for_append(self.path, start_step)
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", file=self.stream,
                             disable=None, dynamic_ncols=True)  # disable=None: hidden when not a tty
        if wandb is not None:
            self._wandb = _start_wandb(run_dir, **wandb)
        if tensorboard:
            self._tensorboard = _start_tensorboard(Path(run_dir) / "tensorboard", start_step)

    def record(self, m: StepMetrics) -> dict[str, Any]:
        """Store one step (every rank may call it; only the writer does I/O); returns its JSON object."""
        row = self._row(m)
        if not self.writer:
            return row
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=m.step)
        if self._tensorboard is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tensorboard.add_scalar(key, value, m.step)
        self._interval.append(m)
        if self._bar is not None:
            self._bar.update(1)
        if m.step % self.log_interval == 0 or m.val_loss is not None:
            self._print(self.summary_line(self._interval, row))
            self._interval = []
        return row

    def _row(self, m: StepMetrics) -> dict[str, Any]:
        tokens_per_s = m.tokens / m.seconds if m.seconds > 0 else None
        tflops, mfu = self._throughput(m.tokens, m.seconds)
        row: dict[str, Any] = {
            "step": m.step, "loss": _finite(m.loss), "lr": m.lr, "grad_norm": _finite(m.grad_norm),
            "loss_scale": m.loss_scale, "skipped_steps": m.skipped_steps, "tokens": m.tokens,
            "step_time_s": m.seconds, "tokens_per_s": tokens_per_s, "tflops_per_device": tflops, "mfu": mfu,
        }
        if m.consumed_samples is not None:
            row["consumed_samples"] = m.consumed_samples
        if m.host_wait_s is not None:
            row["host_wait_s"] = m.host_wait_s
        if m.val_loss is not None:
            val = _finite(m.val_loss)
            row["val_loss"] = val
            # exp overflows a float past 709.78: JSON has no inf, so null (the line says inf)
            row["val_ppl"] = None if val is None or val > MAX_EXP else math.exp(val)
        if self.device is not None:
            row.update(memory_gib(self.device))
        return row

    def _throughput(self, tokens: int, seconds: float) -> tuple[Optional[float], Optional[float]]:
        if seconds <= 0:
            return None, None
        flops_per_device = tokens * self.flops_per_token / seconds / self.num_devices
        mfu = flops_per_device / self.peak_flops if self.peak_flops else None
        return flops_per_device / 1e12, mfu

    def summary_line(self, steps: list[StepMetrics], last: dict[str, Any]) -> str:
        """The stdout line for an interval ending with the step whose JSON object is ``last``."""
        losses = [m.loss for m in steps if m.loss is not None and math.isfinite(m.loss)]
        tokens, seconds = sum(m.tokens for m in steps), sum(m.seconds for m in steps)
        tflops, mfu = self._throughput(tokens, seconds)
        parts = [f"step {last['step']}",
                 f"loss {sum(losses) / len(losses):.6f}" if losses else "loss nan",
                 f"lr {last['lr']:.3e}",
                 f"grad norm {last['grad_norm']:.4f}" if last["grad_norm"] is not None else "grad norm nan",
                 f"loss scale {last['loss_scale']:g}",
                 f"skipped {last['skipped_steps']}",
                 f"{tokens / seconds:,.0f} tok/s" if seconds > 0 else "tok/s n/a",
                 f"{tflops:.4g} TFLOP/s/device" if tflops is not None else "TFLOP/s n/a",
                 f"MFU {100 * mfu:.1f}%" if mfu is not None else "MFU n/a"]
        if "mem_gib" in last:
            parts.append(f"mem {last['mem_gib']:.1f}/{last['mem_peak_gib']:.1f} GiB")
        elif "rss_peak_gib" in last:
            parts.append(f"rss {last['rss_peak_gib']:.2f} GiB")
        if "val_loss" in last:  # an evaluation step; a NaN loss is said, not left out
            val, ppl = last["val_loss"], last["val_ppl"]
            parts.append("val loss nan ppl nan" if val is None else
                         f"val loss {val:.6f} ppl {'inf' if ppl is None else format(ppl, '.2f')}")
        return " | ".join(parts)

    def _print(self, line: str) -> None:
        if self._bar is not None and not self._bar.disable:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        """Flush and close every sink; safe to call twice."""
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()
        self._file = self._bar = self._wandb = self._tensorboard = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: str | os.PathLike, *, warn: Optional[TextIO] = None) -> list[dict[str, Any]]:
    """One row per step as the run finally computed it: rows written after a resume marker replace
    those of the same and later steps written before it; resume markers themselves are left out,
    and lines that are not JSON (a torn write) are skipped with a warning on ``warn`` (stderr)."""
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            try:
                row = json.loads(line)
                step = row["step"]
            except (json.JSONDecodeError, TypeError, KeyError):
                print(f"megazero: {path}: skipping malformed line {number}: {line.strip()[:60]!r}",
                      file=warn or sys.stderr)
                continue
            if row.get("event") == "resume":
                rows = [r for r in rows if r["step"] <= step]
            elif "event" not in row:
                rows.append(row)
    return rows


def open_for_append(path: Path, start_step: int) -> TextIO:
    """Open ``path`` to append steps after ``start_step``: a torn last line is ended first so new
    lines never merge with it, and a resume (``start_step > 0``) or a fresh start over old lines
    is marked."""
    size = path.stat().st_size if path.exists() else 0
    torn = False
    if size:
        with open(path, "rb") as existing:
            existing.seek(size - 1)
            torn = existing.read(1) != b"\n"
    f = open(path, "a", encoding="utf-8")
    if size:
        if torn:
            f.write("\n")
        f.write(json.dumps({"event": "resume", "step": start_step, "time": time.time()}) + "\n")
        f.flush()
    return f


def missing_logger(field: str, package: str) -> str:
    """What a run is told when ``field`` turns on a logger whose ``package`` is not installed (by
    ``--check`` before the run, and here if that was skipped)."""
    return f"{field}: is on but the {package} package is not installed; pip install {package} or set {field} false"


def _start_wandb(run_dir, project: str = "megazero", mode: str = "offline", config: Optional[dict] = None,
                 name: Optional[str] = None):
    try:
        import wandb
    except ImportError:
        raise UserError(missing_logger("logging.wandb", "wandb")) from None
    try:
        return wandb.init(project=project, mode=mode, dir=str(run_dir), config=config, name=name)
    except wandb.errors.Error as exc:  # online without a login or a reachable server: its own traceback
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"logging.wandb_mode {mode}: wandb could not start ({said}); log in (`wandb login`, or "
                        "WANDB_API_KEY), or set logging.wandb_mode offline and `wandb sync` the run later") from None


def _start_tensorboard(log_dir: Path, start_step: int = 0):
    """A writer that hides the events of steps after ``start_step`` left by an earlier run in
    ``log_dir`` (``purge_step``): a resumed run recomputes them, and TensorBoard would otherwise plot
    both values of each such step, as ``read_metrics`` does not."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError(missing_logger("logging.tensorboard", "tensorboard")) from None
    return SummaryWriter(log_dir=str(log_dir), purge_step=start_step + 1)
