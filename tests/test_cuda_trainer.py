"""The trainer on GPUs: the loop that queues step N+1 (or more: ``train.steps_ahead``) before reading
step N, its stop agreement over a gloo group beside NCCL, the pinned-memory copies of each step's
loss and norm, evaluation and checkpoints, at world 2 (tp 2; tp 2 with sequence parallelism through
peer memory, its blocks replayed as CUDA graphs, as the defaults choose there; dp 2 under ZeRO 1) on
two GPUs;
and ``logging.profile_steps`` writing each rank's trace with its kernels and only the window's steps.

Each run trains the small GPT of ``tests/test_trainer.py`` for 8 steps in fp32 (compiled, the GPU
default), evaluating and saving every 3 steps, and must log the training and validation losses
(at steps 3 and 6) of the same run on one CPU process, within 1e-3 relative (GPU and CPU kernels
sum in other orders), and leave checkpoints of steps 3, 6 and 8.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os

import pytest
import torch

from megazero.metrics import read_metrics
from tests.distributed import run_world
from tests.test_trainer import _overrides, _train, step_dirs, write_arithmetic_shard

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

STEPS = 8
LAYOUTS = {"tp2": ("--parallel.tp", "2"), "dp2": (),
           # the defaults pick the fastest tensor-parallel setting inside a node: peer-memory linears
           # in CUDA-graph blocks
           "tp2-sp": ("--parallel.tp", "2", "--parallel.sequence_parallel", "true"),
           # two steps queued ahead, steps 4-5 profiled on both ranks
           "dp2-ahead2-profiled": ("--train.steps_ahead", "2", "--logging.profile_steps", "[4, 5]",
                                   "--logging.profile_ranks", "[0, 1]")}


def _run(root: str, name: str, device: str, extra: tuple, world: int) -> dict:
    run = os.path.join(root, name)
    _train(_overrides(f"{root}/arith_text_document", run, steps=STEPS, extra=(
        "--train.device", device, "--data.split", "9,1,0", "--train.eval_interval", "3", "--train.eval_steps", "1",
        "--checkpoint.save_interval", "3", *extra)), world)
    rows = read_metrics(os.path.join(run, "metrics.jsonl"))
    return {"loss": [r["loss"] for r in rows if "loss" in r],
            "val_steps": [r["step"] for r in rows if r.get("val_loss") is not None],
            "val_loss": [r["val_loss"] for r in rows if r.get("val_loss") is not None],
            "checkpoints": step_dirs(os.path.join(run, "checkpoints")),
            "traces": {name: _trace(os.path.join(run, "profile", name))
                       for name in sorted(os.listdir(os.path.join(run, "profile")))}
            if os.path.isdir(os.path.join(run, "profile")) else {}}


def _trace(path: str) -> tuple[int, list[str]]:
    """(the trace's kernel count, its step ranges in order)."""
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return (sum(e.get("cat") == "kernel" for e in events),
            sorted(e["name"] for e in events  # the host's ranges (each also marks the GPU streams it ran on)
                   if e.get("cat") == "user_annotation" and str(e.get("name")).startswith("megazero step ")))


def _cpu(rank, world, root):
    write_arithmetic_shard(f"{root}/arith_text_document", 400)
    return _run(root, "cpu", "cpu", (), world)


def _gpus(rank, world, root):
    runs = {}
    for name, extra in LAYOUTS.items():
        said = io.StringIO()
        with contextlib.redirect_stdout(said):  # rank 0's lines, among them what the auto settings became
            runs[name] = _run(root, name, "cuda", extra, world)
        runs[name]["said"] = said.getvalue()
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("trainer"))
    cpu = run_world(1, _cpu, root, timeout=300)[0]
    return cpu, run_world(2, _gpus, root, timeout=900, backend="nccl")[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_trainer_on_gpus_matches_one_cpu_process(runs, layout):
    cpu, gpus = runs
    run = gpus[layout]
    assert run["loss"] == pytest.approx(cpu["loss"], rel=1e-3)
    assert run["val_steps"] == [3, 6]
    assert run["val_loss"] == pytest.approx(cpu["val_loss"], rel=1e-3)
    assert run["checkpoints"] == ["step_0000003", "step_0000006", "step_0000008"]


def test_profiled_steps_hold_each_ranks_kernels(runs):
    traces = runs[1]["dp2-ahead2-profiled"]["traces"]
    assert sorted(traces) == ["rank0_steps4-5.json.gz", "rank1_steps4-5.json.gz"], traces
    assert all(kernels > 0 and steps == ["megazero step 4", "megazero step 5"]
               for kernels, steps in traces.values()), traces


def test_defaults_choose_peer_memory_in_cuda_graphs_for_sequence_parallel_tp(runs):
    said = runs[1]["tp2-sp"]["said"]
    assert "megazero: parallel.tp_comm auto -> peer_memory, train.cuda_graphs null -> true on this machine" in said
    assert "parallel.tp_comm auto -> overlap, train.cuda_graphs null -> false" in runs[1]["tp2"]["said"]
