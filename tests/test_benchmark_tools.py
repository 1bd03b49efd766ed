"""The benchmark tools that turn raw records into the figures quoted in BENCHMARKS.md.

``benchmarks/trace_summary.py`` reads a profiler timeline: self times must subtract children even when
a parent and its first child start together, an idle gap must be charged to the host operation that
launched the work ending it (through the kernel's correlation id, on that operation's own thread),
and copies must not count as computing. ``benchmarks/loss_curves.py`` compares runs' loss curves
against a reference: a deviation over the tolerance or a missing step must fail the comparison.
"""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from megazero.config import load_config, save_config

BENCHMARKS = pathlib.Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import loss_curves  # noqa: E402
import trace_summary  # noqa: E402


def _op(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def _kernel(name, ts, dur, correlation, cat="kernel", stream=7):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": stream,
            "args": {"stream": stream, "correlation": correlation}}


def test_self_time_subtracts_a_child_that_starts_with_its_parent():
    # listed child first: a sort on start time alone would nest the parent inside the child
    thread = trace_summary.HostThread([_op("child", 0, 40), _op("parent", 0, 100), _op("grandchild", 10, 5)])
    times = thread.self_times()
    assert times == {"parent": 60, "child": 35, "grandchild": 5}
    assert thread.innermost(12) == "grandchild"


def test_gap_is_charged_to_the_launching_op_and_copies_are_not_compute(tmp_path, capsys):
    events = [
        _kernel("gemm", 0, 100, 1),
        _kernel("Memcpy DtoD", 100, 50, 2, cat="gpu_memcpy"),
        _kernel("gemm", 400, 100, 3),  # a 250 us gap before it
        _op("aten::mm", 0, 10), _op("CompiledFxGraph", 390, 20, tid=2), _op("aten::mm", 395, 5, tid=2),
        _op("Optimizer.step", 100, 300),  # running on the other thread while the GPU idles
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 396, "dur": 2, "pid": 1, "tid": 2,
         "args": {"correlation": 3}},
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    trace_summary.summarize(trace_summary.load(str(path)), top=5)
    out = capsys.readouterr().out
    assert "compute kernels (not NCCL) 0.2 ms (40.0%)" in out
    assert "copies and memsets 0.1 ms" in out
    gap_line = next(line for line in out.splitlines() if "0.25 ms at" in line)
    assert gap_line.rstrip().endswith("aten::mm"), gap_line  # launched from tid 2's mm, not the optimizer


def test_a_trainer_trace_counts_its_steps_from_the_step_ranges(tmp_path, capsys):
    events = [_kernel("nvjet_sm90_tst_128x256_NTN", 0, 300, 1), _kernel("nvjet_sm90_tst_128x256_NTN", 400, 300, 2),
              _op("megazero step 7", 0, 120, cat="user_annotation"), _op("megazero step 8", 130, 90, cat="user_annotation"),
              # the same range as the profiler also marks it on the GPU stream its kernels ran on
              _op("megazero step 7", 0, 300, tid=7, cat="gpu_user_annotation")]
    trace_summary.summarize(events, top=1)
    out = capsys.readouterr().out
    assert "host time to queue each step (ms): step 7 0.1, step 8 0.1" in out
    assert "all 0.3" in out  # 600 us of GEMMs over the two steps
    trace_summary.summarize(events, top=1, steps=1)
    assert "all 0.6" in capsys.readouterr().out


def test_collective_exposure_counts_only_time_without_compute_beside_it():
    gpu = [_kernel("gemm", 0, 100, 1), _kernel("ncclDevKernel_AllGather_RING_LL(x)", 50, 100, 2),
           _kernel("ncclDevKernel_Reduce_Sum(x)", 300, 40, 3)]
    table = trace_summary.collective_table(gpu, trace_summary.compute_intervals(gpu))
    assert table["AllGather_RING_LL"] == [1, 100, 50]  # half of it beside the GEMM
    assert table["Reduce_Sum"] == [1, 40, 40]


def test_kind_table_sorts_kernels_by_kind_per_step(capsys):
    gpu = [_kernel("nvjet_sm90_tst_128x256_NTN", 0, 600, 1), _kernel("ncclDevKernel_SendRecv(x)", 0, 40, 2),
           _kernel("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", 600, 200, 3),
           _kernel("triton_poi_fused_gelu_0", 800, 60, 4), _kernel("Memset (Device)", 860, 2, 5, cat="gpu_memset"),
           _kernel("_adamw_tiles", 862, 98, 6)]
    assert [trace_summary.kernel_kind(e) for e in gpu] == [
        "GEMMs", "NCCL", "attention", "inductor Triton", "copies and memsets", "other"]
    trace_summary.kind_table(gpu, steps=2, top=1)
    out = capsys.readouterr().out
    assert "all 0.5" in out and "0.30      0.5  GEMMs" in out  # per step: 1000 us over 2 steps; one GEMM in 2
    assert out.rstrip().endswith("nvjet_sm90_tst_128x256_NTN")  # the longest kernel


def _run_dir(root: pathlib.Path, name: str, losses: dict[int, float], tp: int = 1) -> str:
    run = root / name
    run.mkdir()
    cfg = load_config(None, ["--parallel.tp", str(tp), "--parallel.dp", "1", "--model.num_heads", "4"])
    save_config(cfg, str(run / "config.yaml"))
    with open(run / "metrics.jsonl", "w") as f:
        for step, loss in losses.items():
            f.write(json.dumps({"step": step, "loss": loss, "tokens_per_s": 1000.0 * tp, "mfu": 0.5}) + "\n")
    return str(run)


@pytest.mark.parametrize("change, passes", [(None, True), ("deviate", False), ("drop", False)])
def test_loss_curves_fail_on_a_deviation_or_a_missing_step(tmp_path, change, passes):
    losses = {step: 10.0 - 0.1 * step for step in range(1, 11)}
    other = dict(losses)
    if change == "deviate":
        other[7] *= 1.03
    elif change == "drop":
        del other[10]
    ref = _run_dir(tmp_path, "ref", losses)
    run = _run_dir(tmp_path, "run", {s: v * (1 + 1e-4) for s, v in other.items()}, tp=2)
    result = subprocess.run([sys.executable, str(BENCHMARKS / "loss_curves.py"), ref, run, "--tolerance", "0.02",
                             "--skip", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == (0 if passes else 1), result.stderr
    line = json.loads(result.stdout.splitlines()[-1])
    assert line["within_tolerance"] is passes
    assert line["tp"] == 2 and line["tokens_per_s_per_rank"] == 1000.0  # 2000 tokens/s over its 2 ranks
    if change == "deviate":
        assert line["at_step"] == 7


def test_loss_curves_compare_counts_every_reference_step():
    reference = {1: {"loss": 2.0}, 2: {"loss": 1.0}}
    assert loss_curves.compare(reference, {1: {"loss": 2.0}})["missing_steps"] == [2]
    assert loss_curves.compare(reference, {1: {"loss": 2.0}, 2: {"loss": 1.5}})["max_rel_loss_deviation"] == 0.5


@pytest.mark.slow
def test_three_axes_follow_one_rank_through_the_users_path(tmp_path):
    """The user's path end to end on CPU: ``scripts/pretrain_gpt.sh`` trains the demo config for ten
    steps on one rank and on eight (tp 2 x pp 2 x dp 2 with sequence parallelism, ZeRO 3), on the demo
    corpus, and ``loss_curves.py`` finds the same fp32 losses (the 8-GPU run's rehearsal)."""
    root = pathlib.Path(__file__).parents[1]
    if not (root / "data/demo/stdlib_text_document.idx").exists():
        subprocess.run([sys.executable, "-m", "megazero.cli", "demo-corpus", "data/demo"], cwd=root, check=True,
                       capture_output=True, timeout=600)
    common = ["--train.train_steps", "10", "--train.eval_interval", "0", "--checkpoint.save_on_exit", "false"]
    runs = {"one": ("1", ["--parallel.tp", "1", "--parallel.pp", "1"]),
            "three-axes": ("8", ["--parallel.sequence_parallel", "true", "--zero.stage", "3"])}
    for name, (ranks, layout) in runs.items():
        env = {**os.environ, "CONFIG": "configs/demo.yaml", "NPROC_PER_NODE": ranks,
               "MASTER_PORT": "29533"}
        done = subprocess.run(["bash", "scripts/pretrain_gpt.sh", *common, *layout,
                               "--logging.run_dir", str(tmp_path / name)], cwd=root, env=env,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    compared = subprocess.run([sys.executable, str(BENCHMARKS / "loss_curves.py"), str(tmp_path / "one"),
                               str(tmp_path / "three-axes"), "--tolerance", "1e-5"],
                              capture_output=True, text=True, timeout=120)
    assert compared.returncode == 0, compared.stdout + compared.stderr
    assert json.loads(compared.stdout.splitlines()[-1])["steps"] == 10


def test_text_batch_joins_documents_in_order_and_rejects_ids_outside_the_vocabulary(tmp_path):
    import numpy as np
    from data_pipeline.indexed import IndexedDatasetWriter
    import train_gpu

    prefix = str(tmp_path / "text")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for start in (0, 5, 12):  # documents of 5, 7 and 30 tokens: 0..4, 5..11, 12..41
            w.add_document(np.arange(start, start + (5 if start == 0 else 7 if start == 5 else 30), dtype=np.uint16))
    batch = train_gpu.text_batch(prefix, micros=2, mbs=3, seq=4, vocab=64)
    rows = np.arange(30).reshape(6, 5)  # 2 x 3 rows of seq + 1 consecutive tokens
    for k, mb in enumerate(batch):
        assert mb["tokens"].tolist() == rows[3 * k:3 * k + 3, :-1].tolist()
        assert mb["labels"].tolist() == rows[3 * k:3 * k + 3, 1:].tolist()
    with pytest.raises(SystemExit, match="token id 29 is outside the vocabulary of 20"):
        train_gpu.text_batch(prefix, micros=2, mbs=3, seq=4, vocab=20)
    with pytest.raises(SystemExit, match="42 tokens, 50 needed"):
        train_gpu.text_batch(prefix, micros=2, mbs=5, seq=4, vocab=64)


def test_clock_summary_takes_the_busy_samples_only_and_counts_the_power_cap():
    import power_cap

    lines = ["345, 80.1, 0, 0x0000000000000001, 31",  # idle before the run
             "1980, 310.0, 89, 0x0000000000000000, 40",  # compiling, just under the busy threshold
             "1590, 692.0, 100, 0x0000000000000004, 58",
             "1605, 693.5, 90, 0x0000000000000004, 57",
             "1620, 690.0, 99, 0x0000000000000000, 55",
             "[N/A], [N/A], 100, 0x0, 50",  # a field the driver could not read
             "1605, 69"]  # the last line, cut short when the sampler stopped
    assert power_cap.summarize(lines) == {"sm_MHz": 1605.0, "power_W": 692.0, "power_capped": 0.67, "temp_C": 57.0,
                                          "clock_samples": 3}
    assert power_cap.summarize(lines[:2]) == {"sm_MHz": None, "power_W": None, "power_capped": None, "temp_C": None,
                                              "clock_samples": 0}


def test_clock_sampler_maps_cuda_devices_to_nvidia_smi_indices(monkeypatch):
    import power_cap

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert power_cap.ClockSampler().gpu == "2"
    assert power_cap.visible_gpu(1) == "3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert power_cap.ClockSampler().gpu == "0"
    assert power_cap.visible_gpu(1) == "1"
    with power_cap.ClockSampler(interval_ms=10) as clock:  # without nvidia-smi every field is None
        pass
    if shutil.which("nvidia-smi") is None:
        assert clock.summary() == {"sm_MHz": None, "power_W": None, "power_capped": None, "temp_C": None,
                                   "clock_samples": 0}


def _two_ranks(rank, world_size):
    """What a benchmark gathers across ranks, on two: clocks, and per pipeline rank (rank 0 is pipeline
    rank 1 and rank 1 pipeline rank 0 in ``busy``, so that a rank mistaken for its pipeline rank shows)."""
    from types import SimpleNamespace

    import torch
    import train_gpu

    clocks = train_gpu.clocks_by_rank({"sm_MHz": 1500.0 + rank, "power_W": 690.0, "temp_C": 60.0 - rank})
    largest = train_gpu.by_pipeline_rank(0, 2, 5.0 - 3.0 * rank)  # both ranks on pipeline rank 0
    stats = SimpleNamespace(bubble=0.25, compute_s=0.002 * (rank + 1), step_s=1.0)
    engine = SimpleNamespace(cfg=SimpleNamespace(parallel=SimpleNamespace(pp=2, virtual_stages=1)),
                             executor=SimpleNamespace(profile=False, stats=stats, schedule="1f1b"),
                             topo=SimpleNamespace(rank=rank, pp_rank=1 - rank), device=torch.device("cpu"),
                             train_step=lambda batch: None)
    busy = train_gpu.pipeline_bubble(engine, [{}] * 4, steps=1)["busy_ms_by_pp_rank"]
    return {"clocks": clocks, "largest": largest, "busy": busy}


@pytest.fixture(scope="module")
def two_ranks():
    from tests.distributed import run_world

    return run_world(2, _two_ranks)


def test_every_ranks_clock_is_reported_in_rank_order(two_ranks):
    """A pipeline's ranks need not clock alike, so a multi-rank benchmark reports each one's (planted:
    rank 0's sample repeated for every rank)."""
    for report in two_ranks:
        assert report["clocks"] == {"sm_MHz_by_rank": [1500.0, 1501.0], "temp_C_by_rank": [60.0, 59.0]}


def test_per_pipeline_rank_figures_take_each_pipeline_ranks_largest(two_ranks):
    """``by_pipeline_rank``: each pipeline rank's largest value over its ranks, and 0 for a pipeline
    rank no rank reported (planted: the last rank's value winning; each rank keeping its own only).
    ``busy_ms_by_pp_rank``: each pipeline rank's compute time of the profiled step, placed by its
    pipeline rank (planted: the step's time instead; the global rank instead of the pipeline rank)."""
    for report in two_ranks:
        assert report["largest"] == [5.0, 0.0]
        assert report["busy"] == [4.0, 2.0]


def _composed_peer_losses(processes: int, *layout: str) -> list[float]:
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
                           "--master-port", "29534", str(BENCHMARKS / "peers/composed_parallel.py"), "--cpu",
                           *layout], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["cpu_losses"]


@pytest.mark.slow  # four torchrun launches of four ranks: minutes on two cores, and it checks a peer, not megazero
def test_composed_torch_peer_trains_the_one_process_losses_in_every_four_rank_layout():
    """The torch-native peer for two axes at once (``benchmarks/peers/composed_parallel.py``: DTensor
    tensor parallelism with sequence parallelism, ``torch.distributed.pipelining``, FSDP2) must do the
    work of the model it stands for: tp 2 x dp 2, pp 2 x dp 2 and tp 2 x pp 2 give one process's fp32
    losses over three AdamW steps of the same global batch. The replicas train on different slices
    of it (planted: without FSDP2 the replicas train apart, 0.09 lower by the third step; gradients
    summed over the replicas instead of averaged move the third loss by 3e-5, beyond the tolerance)."""
    reference = _composed_peer_losses(1, "--micro-batches", "8")
    for layout, micro_batches in ((["--tp", "2"], "4"), (["--pp", "2"], "4"), (["--tp", "2", "--pp", "2"], "8")):
        assert _composed_peer_losses(4, *layout, "--micro-batches", micro_batches) == pytest.approx(
            reference, abs=5e-6), layout
