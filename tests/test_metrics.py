"""FLOP counting against hand computation and Megatron's formula; the peak table; the metrics sinks."""

from __future__ import annotations

import io
import json
import math
import sys
import types
from fractions import Fraction

import pytest
import torch

from megazero.errors import UserError
from megazero.flops import flops_per_token, peak_flops
from megazero.metrics import MetricsLogger, StepMetrics, memory_gib, read_metrics
from models.config import ModelConfig

TINY = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, vocab_size=512, seq_length=128)
GQA = ModelConfig(num_layers=3, hidden_size=128, num_heads=8, num_kv_heads=2, ffn_hidden_size=320,
                  activation="swiglu", vocab_size=1000, seq_length=64)


# --- FLOPs --------------------------------------------------------------------------------------

def test_tiny_gpt_flops_by_hand():
    qkv = 2 * 64 * (64 + 2 * 64)   # 24,576
    out = 2 * 64 * 64              # 8,192
    core = 4 * 128 * 64            # 32,768: QK^T and PV over 128 positions
    mlp = 2 * 64 * 256 * 2         # 65,536: fc_in and fc_out, ffn = 4h = 256
    head = 2 * 64 * 512            # 65,536
    assert flops_per_token(TINY) == 3 * (2 * (qkv + out + core + mlp) + head) == 983_040


def test_gqa_swiglu_flops_by_hand():
    qkv = 2 * 128 * (128 + 2 * 2 * 16)  # 2 kv heads of 16 dims each for keys and values
    out = 2 * 128 * 128
    core = 4 * 64 * 128
    mlp = 2 * 128 * 320 * 3             # gate, up and down matrices
    block, head = qkv + out + core + mlp, 2 * 128 * 1000
    assert flops_per_token(GQA) == 3 * (3 * block + head) == 4_012_032
    assert flops_per_token(GQA, "selective") == 4_012_032 + 3 * core
    assert flops_per_token(GQA, "full", recompute_every=2) == 4_012_032 + 2 * block  # blocks 0 and 2


@pytest.mark.parametrize("layers,hidden,seq,vocab", [(24, 2048, 2048, 50257), (105, 20480, 2048, 51200)])
def test_matches_megatron_paper_formula(layers, hidden, seq, vocab):
    """Narayanan et al. 2021: 96*B*s*l*h^2*(1 + s/6h + V/16lh) per batch with full recompute."""
    cfg = ModelConfig(num_layers=layers, hidden_size=hidden, num_heads=hidden // 128, vocab_size=vocab,
                      seq_length=seq)
    l, h, s, v = layers, hidden, seq, vocab
    with_recompute = 96 * s * l * h**2 * (1 + Fraction(s, 6 * h) + Fraction(v, 16 * l * h)) / s
    without = 72 * s * l * h**2 * (1 + Fraction(s, 6 * h) + Fraction(v, 12 * l * h)) / s
    assert flops_per_token(cfg, "full") == with_recompute
    assert flops_per_token(cfg) == without


def test_matches_six_n_plus_attention():
    n_matmul = 2 * (12 * 64 * 64) + 64 * 512  # per block 4h^2 attention + 8h^2 MLP weights, plus the head
    assert flops_per_token(TINY) == 6 * n_matmul + 12 * 2 * 128 * 64


def test_unknown_recompute_mode():
    with pytest.raises(ValueError, match="recompute"):
        flops_per_token(TINY, "some")


# --- peak table ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name,dtype,tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989), ("NVIDIA H100 80GB HBM3", "fp32", 67),
    ("NVIDIA H100 PCIe", "bf16", 756), ("NVIDIA H100 NVL", "fp16", 835),
    ("NVIDIA H800", "bf16", 989), ("NVIDIA H800 PCIe", "bf16", 756),  # the PCIe card had the SXM's peak
    ("NVIDIA H200", "bf16", 989), ("NVIDIA H200 NVL", "bf16", 835), ("NVIDIA GH200 480GB", "bf16", 989),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312), ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
    ("Tesla V100-SXM2-32GB", "fp16", 125), ("Tesla V100-PCIE-16GB", "fp16", 112),
    ("Tesla V100S-PCIE-32GB", "fp16", 130),
    ("NVIDIA L40S", "bf16", 362), ("NVIDIA L40", "bf16", 181), ("NVIDIA L4", "bf16", 121),
    ("AMD Instinct MI300X", "bf16", 1307.4),
])
def test_peak_table(name, dtype, tflops):
    assert peak_flops(name, dtype) == pytest.approx(tflops * 1e12)


@pytest.mark.parametrize("name,dtype", [("NVIDIA GeForce GTX 1080", "fp32"), ("Tesla V100-SXM2-16GB", "bf16"),
                                        (None, "bf16"), ("", "fp32")])
def test_unknown_device_or_dtype_has_no_peak(name, dtype):
    assert peak_flops(name, dtype) is None


# --- the logger ---------------------------------------------------------------------------------

def step(n, loss=2.5, seconds=0.5, grad_norm=0.75, **kw):
    return StepMetrics(step=n, loss=loss, lr=1e-4 * n, grad_norm=grad_norm, tokens=4096, seconds=seconds, **kw)


def logger(tmp_path, stream=None, **kw):
    args = dict(total_steps=10, log_interval=2, flops_per_token=1_000_000, num_devices=2, peak_flops=1e12,
                stream=stream if stream is not None else io.StringIO())
    args.update(kw)
    return MetricsLogger(tmp_path, **args)


def test_jsonl_has_one_object_per_step_with_required_fields(tmp_path):
    with logger(tmp_path) as log:
        for n in (1, 2, 3):
            log.record(step(n))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "loss_scale", "skipped_steps"):
        assert key in rows[0]


def test_throughput_and_mfu_arithmetic(tmp_path):
    with logger(tmp_path) as log:
        row = log.record(step(1, seconds=0.5))
    assert row["tokens_per_s"] == pytest.approx(8192)
    # 8192 tok/s * 1e6 FLOP/tok / 2 devices = 4.096e9 FLOP/s per device, 0.4096% of 1e12
    assert row["tflops_per_device"] == pytest.approx(4.096e-3, rel=1e-12)
    assert row["mfu"] == pytest.approx(4.096e-3, rel=1e-12)


def test_unknown_peak_reports_no_mfu(tmp_path):
    out = io.StringIO()
    with logger(tmp_path, out, peak_flops=None) as log:
        log.record(step(1))
        row = log.record(step(2))
    assert row["mfu"] is None and row["tflops_per_device"] is not None
    assert "MFU n/a" in out.getvalue()


def test_loss_is_written_to_full_double_precision(tmp_path):
    loss = 1 / 3 + 1e-13
    with logger(tmp_path) as log:
        log.record(step(1, loss=loss))
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line)["loss"] == loss  # bitwise: repr round-trips a double


def test_one_line_per_log_interval_with_interval_means(tmp_path):
    out = io.StringIO()
    with logger(tmp_path, out, log_interval=2) as log:
        for n, loss in zip(range(1, 6), (1.0, 2.0, 3.0, 5.0, 9.0)):
            log.record(step(n, loss=loss, skipped_steps=1, loss_scale=4096.0))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step 2 |") and "loss 1.500000" in lines[0]
    assert "loss 4.000000" in lines[1]
    for field in ("lr 4.000e-04", "grad norm 0.7500", "loss scale 4096", "skipped 1", "8,192 tok/s",
                  "TFLOP/s/device", "MFU 0.4%"):
        assert field in lines[1]


def test_interval_throughput_is_its_tokens_over_its_wall_time(tmp_path):
    """Steps of 0.5 s and 1.5 s with 4096 tokens each: the line says 8192 tokens over 2 s, not the last
    step's rate (2,731 tok/s), nor the mean of the two rates (5,461 tok/s)."""
    out = io.StringIO()
    with logger(tmp_path, out, log_interval=2) as log:
        log.record(step(1, seconds=0.5))
        log.record(step(2, seconds=1.5))
    assert "| 4,096 tok/s | 0.002048 TFLOP/s/device | MFU 0.2%" in out.getvalue(), out.getvalue()


def test_interval_mean_loss_leaves_out_a_skipped_nan_step(tmp_path):
    """A NaN step (skipped by the loss scaler) inside an interval does not turn its mean into nan:
    the line averages the finite losses, (1 + 4) / 2."""
    out = io.StringIO()
    with logger(tmp_path, out, log_interval=3) as log:
        for n, loss in zip((1, 2, 3), (1.0, float("nan"), 4.0)):
            log.record(step(n, loss=loss))
    assert "loss 2.500000" in out.getvalue()


def test_eval_step_adds_val_loss_and_perplexity(tmp_path):
    out = io.StringIO()
    with logger(tmp_path, out, log_interval=100) as log:
        row = log.record(step(3, val_loss=2.0))
    assert row["val_loss"] == 2.0 and row["val_ppl"] == pytest.approx(math.exp(2.0), rel=1e-12)
    assert "val loss 2.000000 ppl 7.39" in out.getvalue()


def test_perplexity_past_a_floats_range_is_null_and_said_as_inf(tmp_path):
    """exp of a loss above 709.78 overflows a double: the row holds null (JSON has no inf) and the
    line says inf (planted: exp(700), about 1e304, reported as the perplexity of a loss of 800)."""
    out = io.StringIO()
    with logger(tmp_path, out, log_interval=100) as log:
        row = log.record(step(3, val_loss=800.0))
        edge = log.record(step(4, val_loss=709.0))
    assert row["val_loss"] == 800.0 and row["val_ppl"] is None and edge["val_ppl"] == math.exp(709.0)
    assert "val loss 800.000000 ppl inf" in out.getvalue()


def test_a_nan_eval_loss_and_its_perplexity_are_null_and_said(tmp_path):
    """The line of an evaluation whose loss is NaN says so (planted: the validation part left out,
    so nothing showed that an evaluation ran)."""
    out = io.StringIO()
    with logger(tmp_path, out, log_interval=100) as log:
        row = log.record(step(3, val_loss=float("nan")))
    written = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert (row["val_loss"], row["val_ppl"]) == (written["val_loss"], written["val_ppl"]) == (None, None)
    assert out.getvalue().rstrip().endswith("| val loss nan ppl nan"), out.getvalue()


def test_nonfinite_loss_and_grad_norm_are_null_not_invalid_json(tmp_path):
    """An overflowed step's loss and gradient norm: JSON has no NaN or Infinity, the row holds null."""
    out = io.StringIO()
    with logger(tmp_path, out, log_interval=1) as log:
        log.record(step(1, loss=float("nan"), grad_norm=float("inf")))
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["loss"] is None and row["grad_norm"] is None
    assert "loss nan" in out.getvalue() and "grad norm nan" in out.getvalue()


def test_non_writer_rank_does_no_io(tmp_path):
    out = io.StringIO()
    with logger(tmp_path / "run", out, writer=False, log_interval=1) as log:
        row = log.record(step(1))
    assert row["step"] == 1
    assert not (tmp_path / "run").exists() and out.getvalue() == ""


def test_resume_supersedes_later_steps_and_a_torn_line_without_truncating(tmp_path):
    with logger(tmp_path) as log:
        for n in range(1, 6):
            log.record(step(n))
    path = tmp_path / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 6, "lo')  # a kill -9 in the middle of a write
    before = path.read_text()
    warnings = io.StringIO()
    with logger(tmp_path, start_step=3) as log:
        log.record(step(4, loss=7.0))
    assert path.read_text().startswith(before), "the record of the run that died must be kept"
    rows = read_metrics(path, warn=warnings)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["loss"] == 7.0
    assert "metrics.jsonl: skipping malformed line 6" in warnings.getvalue()


def test_each_step_is_on_disk_before_the_next_and_resume_markers_are_not_rows(tmp_path):
    """A step's line is flushed as it is recorded, so another process (or a run killed before it
    closes the file) reads it; read_metrics returns step rows only, never the resume marker."""
    path = tmp_path / "metrics.jsonl"
    with logger(tmp_path) as log:
        log.record(step(1))
        assert [r["step"] for r in read_metrics(path)] == [1]
    with logger(tmp_path, start_step=1) as log:
        log.record(step(2))
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == [1, 2] and all("event" not in r for r in rows)


def test_a_fresh_start_over_old_lines_is_marked_not_erased(tmp_path):
    with logger(tmp_path) as log:
        log.record(step(1, loss=5.0))
    with logger(tmp_path, start_step=0) as log:
        log.record(step(1, loss=6.0))
    assert [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [6.0]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_malformed_complete_line_is_skipped_with_a_warning_naming_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n\xff\n')
    warnings = io.StringIO()
    assert [r["step"] for r in read_metrics(path, warn=warnings)] == [1, 3]
    assert "metrics.jsonl: skipping malformed line 2" in warnings.getvalue()
    assert "line 4" in warnings.getvalue()


def test_cpu_memory_is_reported(tmp_path):
    assert memory_gib(torch.device("cpu"))["rss_peak_gib"] > 0
    with logger(tmp_path, device=torch.device("cpu")) as log:
        assert log.record(step(1))["rss_peak_gib"] > 0


def test_cuda_memory_is_reported_and_on_the_line(tmp_path, monkeypatch):
    """On CUDA a row holds the memory allocated now, its peak and the reserved peak (what CUDA-graph pools
    use), each from its own counter, and the line says allocated/peak."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 1.3 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 3.5 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 4.5 * gib)
    out = io.StringIO()
    with logger(tmp_path, out, log_interval=1, device=types.SimpleNamespace(type="cuda")) as log:
        row = log.record(step(1))
    assert (row["mem_gib"], row["mem_peak_gib"], row["mem_reserved_peak_gib"]) == (1.3, 3.5, 4.5)
    assert out.getvalue().rstrip().endswith("| mem 1.3/3.5 GiB"), out.getvalue()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the kernel's own figure in /proc")
def test_cpu_peak_rss_is_in_gib(tmp_path):
    """Linux reports peak RSS in KiB: the figure matches the kernel's VmHWM (kB) over 2**20."""
    reported = memory_gib(torch.device("cpu"))["rss_peak_gib"]
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    high_water_gib = int(status["VmHWM"].split()[0]) / 2**20
    assert reported == pytest.approx(high_water_gib, rel=0.05)


def test_wandb_is_offline_by_default_and_gets_each_step(tmp_path, monkeypatch):
    calls = {"log": []}

    class Run:
        def log(self, data, step):
            calls["log"].append((step, data))

        def finish(self):
            calls["finished"] = True

    def init(**kwargs):
        calls["init"] = kwargs
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with logger(tmp_path, wandb={"project": "p"}) as log:
        log.record(step(1))
        log.record(step(2, seconds=0.0))  # no time measured: no throughput, which wandb is not sent as None
    assert calls["init"]["mode"] == "offline" and calls["init"]["project"] == "p"
    assert calls["log"][0][0] == 1 and calls["log"][0][1]["loss"] == 2.5
    assert calls["log"][1][0] == 2 and not {"tokens_per_s", "tflops_per_device", "mfu"} & set(calls["log"][1][1])
    assert calls["finished"]


def test_wandb_online_without_a_login_is_one_line(tmp_path, monkeypatch):
    """``logging.wandb_mode online`` on a machine with no W&B login ended the run's start in wandb's
    own traceback; it is one line naming the field and the two ways out. (Planted: wandb's error
    let through.)"""
    pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no settings file with a key
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # no terminal to prompt on
    with pytest.raises(UserError) as refused:
        logger(tmp_path / "run", wandb={"project": "p", "mode": "online"})
    said = str(refused.value)
    assert said.startswith("logging.wandb_mode online: wandb could not start (") and "\n" not in said, said
    assert said.endswith("log in (`wandb login`, or WANDB_API_KEY), or set logging.wandb_mode offline and "
                         "`wandb sync` the run later"), said


def test_tensorboard_writes_events_or_says_how_to_install(tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(UserError, match="pip install tensorboard"):
            logger(tmp_path, tensorboard=True)
        return
    with logger(tmp_path, tensorboard=True) as log:
        log.record(step(1))
    assert any((tmp_path / "tensorboard").iterdir())


def test_a_resumed_run_hides_the_tensorboard_events_it_recomputes(tmp_path, monkeypatch):
    """Resumed at step 3, a run logs steps 4 on again; the events of those steps that the run before
    wrote (it got further before it died) are purged, as read_metrics supersedes their rows."""
    made = []

    class Writer:
        def __init__(self, log_dir, **kw):
            made.append(kw)

        def add_scalar(self, *args):
            pass

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    with logger(tmp_path, tensorboard=True, start_step=3) as log:
        log.record(step(4))
    assert made == [{"purge_step": 4}], made
