"""The start-up memory check's suggestion, for a run whose layout is predicted not to fit: it keeps
each tensor-parallel group within a node of the run's ranks, and among equally near layouts it
ranks by the speed of the GPU the run trains on (an H100 for a CPU run with a stated budget)."""

import dataclasses
from types import SimpleNamespace

from megazero.config import load_config, resolve_config
from megazero.planner import estimate_memory
from megazero.planner.fit import Budget, decimals_apart, device_budget, memory_problem
from megazero.planner.hardware import GIB


def budgeted(share, *overrides):
    """A CPU run of a 4-block GPT (4 heads, 512-token samples, 2 micro-batches of 8 per replica at dp 2)
    on 2 ranks, with ``train.memory_budget_gib`` at ``share`` of what its own layout needs."""
    cfg = resolve_config(load_config(None, [
        "--model.num_layers", "4", "--model.num_heads", "4", "--model.seq_length", "512", "--model.vocab_size", "512",
        "--precision.dtype", "bf16", "--train.device", "cpu", "--train.global_batch_size", "16", *overrides]), 2, 2)
    budget = share * estimate_memory(cfg).needed / GIB
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, memory_budget_gib=budget))


def test_the_suggested_layout_keeps_tensor_parallelism_within_a_node():
    """tp 1 x dp 2 of width 256 at ZeRO 0 and micro-batch 1, with 98% of its need: on one node of two
    the nearest layout that fits is tp 2, but with one rank a node a tensor-parallel group would span
    the network, which the trainer refuses, so the suggestion there changes other knobs."""
    cfg = budgeted(0.98, "--model.hidden_size", "256", "--zero.stage", "0", "--train.micro_batch_size", "1")
    assert "nearest layout that fits: --parallel.tp 2 --parallel.dp 1 (" in memory_problem(cfg, ranks_per_node=2)
    apart = memory_problem(cfg, ranks_per_node=1)
    assert "nearest layout that fits:" in apart and "--parallel.tp" not in apart, apart


def test_a_stated_budget_on_a_cpu_run_ranks_near_layouts_by_h100_speed():
    """Width 1024 at ZeRO 2, full recompute, micro-batch 8, with 92% of its need: tp 2 and pp 2 each
    fit with one change. On an H100 this model's forward and backward with recompute take about
    1.8 TFLOP a micro-batch, 3 ms at 989 TFLOP/s x 0.58: pp 2's 1F1B step of two micro-batches is
    (2 + 1) x 1.6 ms, about 5 ms, while tp 2 waits on the host launching its blocks, 6 ms a block
    and micro-batch, 48 ms a step. A V100 (37.5 TFLOP/s) would hide those launches behind 48 ms of
    compute a micro-batch and rank tp 2 first, pp 2's bubble then costing 24 ms."""
    cfg = budgeted(0.92, "--model.hidden_size", "1024", "--zero.stage", "2", "--parallel.recompute", "full",
                   "--train.micro_batch_size", "8")
    assert "nearest layout that fits: --parallel.pp 2 --parallel.dp 1 (" in memory_problem(cfg)


def test_a_stated_budget_on_a_gpu_run_ranks_near_layouts_by_that_gpus_speed(monkeypatch):
    """The same run and budget on a V100 (a GPU run stating less memory than the device has): its
    compute hides tp 2's launches and pp 2's bubble is the larger cost, so tp 2 is named. Ranked by
    the H100 regardless, it named pp 2, a layout about 40% slower on the V100 at hand."""
    cfg = budgeted(0.92, "--model.hidden_size", "1024", "--zero.stage", "2", "--parallel.recompute", "full",
                   "--train.micro_batch_size", "8")
    cfg = on_gpu(monkeypatch, cfg, "Tesla V100-SXM2-32GB")
    assert "nearest layout that fits: --parallel.tp 2 --parallel.dp 1 (" in memory_problem(cfg)


def on_gpu(monkeypatch, cfg, name, gib=32):
    """``cfg`` as a CUDA run on a GPU torch reports as ``name`` with ``gib`` GiB."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(name=name, total_memory=gib * 2**30))
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, device="cuda"))


def test_a_gpu_run_without_a_stated_budget_is_measured_against_the_gpus_memory(monkeypatch):
    """No ``train.memory_budget_gib``: the budget is the memory torch reports, in GiB, and the GPU's
    preset ranks the near layouts."""
    cfg = budgeted(1.0)
    cfg = on_gpu(monkeypatch, dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, memory_budget_gib=None)),
                 "NVIDIA H200", gib=140)
    assert device_budget(cfg) == Budget(140.0, "the NVIDIA H200's memory", "h200")


def test_the_refusal_shows_the_need_above_the_budget():
    """A budget just under the need read "predicts 1.5 GiB ... but 1.5 GiB is available", and a budget of
    0.01 GiB "0.0 GiB is available": the figures carry the decimals that tell them apart."""
    import re

    assert decimals_apart(1.517, 1.51) == 2 and decimals_apart(1.517, 1.2) == 1 and decimals_apart(1.5, 0.01) == 2
    cfg = budgeted(0.999, "--model.hidden_size", "256", "--zero.stage", "0", "--train.micro_batch_size", "1")
    line = memory_problem(cfg)
    needed, budget = re.search(r"predicts ([0-9.]+) GiB .* but ([0-9.]+) GiB is available", line).groups()
    assert float(needed) > float(budget), line
    fits = re.search(r"nearest layout that fits: .* \(([0-9.]+) GiB\)$", line).group(1)  # at one decimal, 1.6 > 1.59
    assert float(fits) <= float(budget) and len(fits) == len(budget), line


def test_a_budget_no_layout_fits_says_what_would_help():
    """A hundredth of what the run needs: no layout of its two ranks fits, and the line says so and what
    would help, where a traceback came of an empty search."""
    line = memory_problem(budgeted(0.01, "--model.hidden_size", "256"))
    assert line.endswith("; no layout of 2 GPUs fits; add GPUs, offload the optimizer (--zero.offload_optimizer true) "
                         "or shrink the model"), line
    offloaded = memory_problem(budgeted(0.01, "--model.hidden_size", "256", "--zero.offload_optimizer", "true"))
    assert offloaded.endswith("; no layout of 2 GPUs fits; add GPUs or shrink the model"), offloaded  # not what it has


def test_a_stated_budget_above_the_gpus_memory_is_refused(monkeypatch):
    """A budget of 40 GiB on a 32 GiB GPU would pass layouts that run out of memory: the check names
    the field, both figures and the fix, before any work."""
    cfg = on_gpu(monkeypatch, budgeted(1.0), "Tesla V100-SXM2-32GB", gib=32)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, memory_budget_gib=40.0))
    assert memory_problem(cfg) == ("train.memory_budget_gib: 40 GiB is more than the 32.0 GiB of the Tesla "
                                   "V100-SXM2-32GB; lower it, or set it null to use the whole GPU")
