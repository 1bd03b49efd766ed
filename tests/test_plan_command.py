"""`megazero plan` as a user runs it: its JSON agrees with evaluating the layout it names, the fields
the command line gives are held, nothing fitting is said and ranked nearest first, a GPU count no
layout can use names the count that can (or, with a field held, the held field), bad flags are one
line, and an fp32 plan notes that the peaks are 16-bit."""

import json
import re

import pytest

from megazero.cli import main
from megazero.config import load_config, resolve_config
from megazero.planner import GPUS, Cluster, evaluate
from megazero.planner.memory import GIB


def test_plan_json(capsys):
    code = main(["plan", "configs/gpt_1.3b.yaml", "--gpus", "4", "--gpus-per-node", "4", "--gpu", "h100",
                 "--top", "3", "--json", "--train.global_batch_size", "64"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpus"] == 4 and out["gpu"]["memory_gib"] == 79.18 and len(out["layouts"]) == 3
    assert out["valid_layouts"] >= out["fitting_layouts"] > 3  # every layout counted, not the rows shown
    best = out["layouts"][0]
    assert best["fits"] and best["tp"] * best["pp"] * best["dp"] == 4
    assert [r["step_s"] for r in out["layouts"]] == sorted(r["step_s"] for r in out["layouts"])
    # what the table predicts for a layout is what evaluating that layout predicts
    cfg = load_config("configs/gpt_1.3b.yaml", ["--train.global_batch_size", "64", *best["overrides"].split()])
    again = evaluate(resolve_config(cfg, 4, 4), Cluster(GPUS["h100"], 4, 4))
    assert again.step.tokens_per_s == pytest.approx(best["tokens_per_s"], abs=1)
    assert again.memory.peak / GIB == pytest.approx(best["memory_gib"], abs=0.01)
    assert again.memory.needed / GIB == pytest.approx(best["needed_gib"], abs=0.01)  # margins included
    assert again.step.step_s == pytest.approx(best["step_s"], rel=1e-3)
    assert again.step.tflops_per_gpu == pytest.approx(best["tflops_per_gpu"], abs=0.05)
    assert again.step.mfu == pytest.approx(best["mfu"], abs=5e-4) and 0 < best["mfu"] < 1  # a fraction, not %


def test_a_plans_flags_hold_where_the_config_file_names_its_dp(tmp_path, capsys):
    """A config file naming ``parallel.dp`` (laid out for 2 GPUs) planned for 4: the rows' flags left
    dp out, as following from the world size, so the file's dp stood beside each row's tp and pp and
    the trainer refused every row. Every row's flags now resolve for the world planned. (Planted: dp
    left out of the flags.)"""
    from pathlib import Path

    (tmp_path / "c.yaml").write_text(Path("configs/gpt_1.3b.yaml").read_text() + "parallel:\n  dp: 2\n")
    assert main(["plan", str(tmp_path / "c.yaml"), "--gpus", "4", "--gpus-per-node", "4", "--gpu", "h100",
                 "--top", "50", "--json", "--train.global_batch_size", "64"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert any(r["dp"] != 2 for r in rows)
    for row in rows:
        cfg = load_config(str(tmp_path / "c.yaml"), ["--train.global_batch_size", "64", *row["overrides"].split()])
        assert resolve_config(cfg, 4, 4).parallel.dp == row["dp"], row


def test_the_table_ends_with_the_launch_of_its_first_row(capsys):
    """The flags of a row were in the JSON alone: the table's reader turned its columns into flags by
    hand. The launch printed holds the plan's own overrides and the first row's flags."""
    assert main(["plan", "configs/gpt_1.3b.yaml", "--gpus", "8", "--gpus-per-node", "8", "--top", "2",
                 "--train.global_batch_size", "64"]) == 0
    out = capsys.readouterr().out
    assert main(["plan", "configs/gpt_1.3b.yaml", "--gpus", "8", "--gpus-per-node", "8", "--top", "1", "--json",
                 "--train.global_batch_size", "64"]) == 0
    first = json.loads(capsys.readouterr().out)["layouts"][0]["overrides"]
    assert out.splitlines()[-1] == ("to train the first: CONFIG=configs/gpt_1.3b.yaml scripts/pretrain_gpt.sh "
                                    f"--train.global_batch_size 64 {first}")


def test_plan_takes_each_hardware_flag_as_its_own_figure(capsys):
    """Each flag replaces its own preset figure (planted: the two bandwidths swapped), and a cluster
    smaller than a node is one node of its own GPUs."""
    code = main(["plan", "configs/demo.yaml", "--gpus", "2", "--gpus-per-node", "8", "--gpu", "a100-80gb",
                 "--gpu-memory", "40", "--peak-tflops", "500", "--intra-node-GBps", "100", "--inter-node-GBps", "12.5",
                 "--top", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and (out["gpus"], out["gpus_per_node"]) == (2, 2)
    gpu = out["gpu"]
    assert (gpu["memory_gib"], gpu["peak_tflops"], gpu["intra_node_GBps"], gpu["inter_node_GBps"]) == (40, 500, 100, 12.5)
    assert (gpu["hbm_GBps"], gpu["efficiency"]) == (2039.0, GPUS["a100-80gb"].efficiency)  # the rest is the preset's


def test_plan_holds_the_searched_fields_the_command_line_gives(capsys):
    """A searched field given as an override (`--zero.stage 3`) is a choice the user made: every
    ranked layout keeps it. One set in the config file only is searched around, and so is any field
    the command line does not name."""
    argv = ["plan", "configs/gpt_1.3b.yaml", "--gpus", "4", "--gpus-per-node", "4", "--top", "1000", "--json",
            "--train.global_batch_size", "64"]
    assert main(argv) == 0
    searched = json.loads(capsys.readouterr().out)["layouts"]
    assert {r["zero_stage"] for r in searched} == {0, 1, 2, 3} and {r["tp"] for r in searched} > {1}
    assert main([*argv, "--zero.stage", "3", "--parallel.tp", "1"]) == 0
    held = json.loads(capsys.readouterr().out)["layouts"]
    assert held and {(r["zero_stage"], r["tp"]) for r in held} == {(3, 1)}
    assert {r["pp"] for r in held} > {1}  # the fields not named are still searched
    assert main([*argv, "--parallel.tp", "4", "--parallel.pp", "4"]) == 2
    assert "with parallel.pp, parallel.tp as given" in capsys.readouterr().err


def test_plan_keeps_a_short_step_time(capsys):
    """A small model's step is well under 0.1 ms on an H100: its step time keeps its significant digits
    (planted: rounded to 4 decimals, every row read 0 s beside its millions of tokens/s)."""
    code = main(["plan", "configs/demo.yaml", "--gpus", "8", "--gpus-per-node", "8", "--top", "3", "--json",
                 "--precision.dtype", "bf16"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    tokens = 32 * 128  # the demo's global batch x seq_length
    assert rows and all(r["step_s"] * r["tokens_per_s"] == pytest.approx(tokens, rel=1e-3) for r in rows), rows
    code = main(["plan", "configs/demo.yaml", "--gpus", "8", "--gpus-per-node", "8", "--top", "1", "--precision.dtype", "bf16"])
    best = capsys.readouterr().out.splitlines()[2].split()
    assert code == 0 and float(best[11]) == pytest.approx(rows[0]["step_s"], rel=1e-2), best


def test_plan_says_when_nothing_fits(capsys):
    """GPT 1.3B on two GPUs of 1 GiB: the same table and line as MT-NLG 530B on eight of 40 GiB, without
    searching 530B's layouts (8 s of the suite)."""
    code = main(["plan", "configs/gpt_1.3b.yaml", "--gpus", "2", "--gpus-per-node", "2", "--gpu-memory", "1",
                 "--train.global_batch_size", "16", "--top", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "0 fit" in out and "none fits" in out
    # what it suggests was not tried: every micro-batch size was, offloading was not; held fields are named
    assert out.splitlines()[-1] == "none fits: add GPUs, offload the optimizer (--zero.offload_optimizer true) or shrink the model"
    code = main(["plan", "configs/gpt_1.3b.yaml", "--gpus", "2", "--gpus-per-node", "2", "--gpu-memory", "1",
                 "--train.global_batch_size", "16", "--top", "2", "--zero.offload_optimizer", "true",
                 "--train.micro_batch_size", "2"])
    assert code == 0 and capsys.readouterr().out.splitlines()[-1] == (
        "none fits: add GPUs, search --train.micro_batch_size instead of holding it at 2 or shrink the model")


def test_plan_fits_layouts_in_the_configs_memory_budget(capsys):
    """``train.memory_budget_gib``, the cap the run's start-up check holds each rank to, is the memory
    the plan fits layouts in: at 20 GiB on H100s, layouts that fit the whole GPU do not."""
    argv = ["plan", "configs/gpt_1.3b.yaml", "--gpus", "4", "--gpus-per-node", "4", "--json", "--top", "400",
            "--train.global_batch_size", "64"]
    assert main(argv) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main([*argv, "--train.memory_budget_gib", "20"]) == 0
    capped = json.loads(capsys.readouterr().out)
    assert capped["gpu"]["memory_gib"] == 20 and whole["fitting_layouts"] > capped["fitting_layouts"] > 0
    assert all(row["needed_gib"] <= 20 for row in capped["layouts"] if row["fits"])
    assert any(20 < row["needed_gib"] <= 79.18 for row in whole["layouts"] if row["fits"])


def test_layouts_that_do_not_fit_come_nearest_first(capsys):
    """When none fits, the rows shown are those closest to fitting, least memory first (planted: the
    config's own layout, and those a knob away from it, led layouts needing a fraction of their memory)."""
    code = main(["plan", "configs/gpt_1.3b.yaml", "--gpus", "2", "--gpus-per-node", "2", "--gpu-memory", "1",
                 "--train.global_batch_size", "16", "--top", "100000", "--json"])
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert code == 0 and rows and not any(r["fits"] for r in rows)
    assert [r["needed_gib"] for r in rows] == sorted(r["needed_gib"] for r in rows)


@pytest.mark.parametrize("overrides, gpus, per_node, usable", [
    (["--train.global_batch_size", "3"], 6, 8, 6),  # part of one node: tp 2 x dp 3
    (["--train.global_batch_size", "2"], 512, 8, 384),  # whole nodes: 24 blocks x tp 8 x dp 2
    (["--train.global_batch_size", "3", "--model.num_layers", "1"], 16, 8, 8),  # not 12 (tp 4 x dp 3): 1.5 nodes
    # 12 heads take tp up to 4: 2 blocks x tp 4, not tp 8
    (["--train.global_batch_size", "1", "--model.num_layers", "2", "--model.num_heads", "12",
      "--model.hidden_size", "768"], 16, 8, 8),
    # tp 4 does not divide a node of 6: beyond one node only tp 2, which 3 blocks and a batch of 1 cap at 6
    (["--train.global_batch_size", "1", "--model.num_layers", "3"], 12, 6, 6),
])
def test_the_gpus_a_plan_could_use_split_as_the_search_splits_them(overrides, gpus, per_node, usable):
    """The "plan for N GPUs" a plan with no valid layout offers: N must split as the search splits a
    world (a part of one node or whole nodes; tp a power of two the model's widths take, within a
    node; pp at most a stage a block; dp dividing the batch), or the user is sent to another count
    that has no layout either."""
    from megazero.planner.search import split_worlds

    assert split_worlds(load_config("configs/gpt_1.3b.yaml", overrides), gpus, per_node)[0] == usable


def test_the_gpus_a_plan_offers_have_a_valid_layout(capsys):
    """32 GPUs for 3 blocks and a batch of 7 with CUDA-graph blocks: 24 split (tp 8 x pp 3), but CUDA
    graphs take no pipeline and a batch of 7 no dp of 2 or more, so 24 had no layout either, and the
    user was sent from one refusal to another. The count offered now plans. (Planted: the largest
    split offered.)"""
    argv = ["plan", "configs/gpt_1.3b.yaml", "--gpus-per-node", "8", "--train.global_batch_size", "7",
            "--model.num_layers", "3", "--train.cuda_graphs", "true"]
    assert main([*argv, "--gpus", "32"]) == 2
    offered = re.search(r"plan for (\d+) GPUs", capsys.readouterr().err).group(1)
    assert main([*argv, "--gpus", offered, "--json"]) == 0, capsys.readouterr().err


def test_a_held_field_on_a_gpu_count_no_layout_splits_names_the_field_not_another_count(capsys):
    """512 GPUs do not split for 24 blocks and a batch of 2: the most a layout can use is 384 (tp 8 x
    pp 24 x dp 2). Holding tp 1, 384 do not split either (pp 24 x dp 2 is 48), so the line names the
    held field, not a count of GPUs the user would find refused in turn."""
    argv = ["plan", "configs/gpt_1.3b.yaml", "--gpus-per-node", "8", "--train.global_batch_size", "2", "--parallel.tp", "1"]
    for gpus in ("512", "384"):
        assert main([*argv, "--gpus", gpus]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "with parallel.tp as given" in err[0] and "plan for" not in err[0], err


@pytest.mark.parametrize("argv, words", [
    (["--gpus", "12", "--gpus-per-node", "8"], ["--gpus 12", "--gpus-per-node 8"]),
    (["--gpus", "8", "--gpus-per-node", "8", "--peak-tflops", "0"], ["--peak-tflops"]),
    (["--gpus", "8", "--gpus-per-node", "8", "--peak-tflops", "inf"], ["--peak-tflops", "finite", "got inf"]),
    (["--gpus", "8", "--gpus-per-node", "8", "--gpu-memory", "inf"], ["--gpu-memory", "finite", "got inf"]),
    (["--gpus", "8", "--gpus-per-node", "8", "--peak-tflops", "1e-320"], ["--peak-tflops", "at least 0.001"]),
    (["--gpus", "8", "--gpus-per-node", "8", "--intra-node-GBps", "1e-320"], ["--intra-node-GBps", "at least 0.001"]),
    # a run's memory cap above what the GPU planned for has (the start-up check refuses it too)
    (["--gpus", "8", "--gpus-per-node", "8", "--train.memory_budget_gib", "100"],
     ["train.memory_budget_gib: 100 GiB is more than the 79.2 GiB of the H100-SXM5-80GB (--gpu h100)"]),
    (["--gpus", "8", "--gpus-per-node", "8", "--gpu-memory", "40", "--train.memory_budget_gib", "60"],
     ["train.memory_budget_gib: 60 GiB is more than the 40.0 GiB given by --gpu-memory"]),
    (["--gpus", "8", "--gpus-per-node", "8", "--train.memory_budget_gib", "0"], ["train.memory_budget_gib", "positive"]),
    # more GPUs than 24 blocks x tp 8 x a batch of 2 can use: why, and the most that can be used
    (["--gpus", "512", "--gpus-per-node", "8", "--train.global_batch_size", "2"],
     ["512 GPUs", "model.num_layers 24", "train.global_batch_size 2", "plan for 384 GPUs"]),
])
def test_plan_bad_input_is_one_line(argv, words, capsys):
    code = main(["plan", "configs/gpt_1.3b.yaml", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and all(w in err[0] for w in words), err


def test_plan_takes_the_least_hardware_figure_each_flag_allows(capsys):
    """0.001 is the least figure a hardware flag takes, itself included."""
    code = main(["plan", "configs/demo.yaml", "--gpus", "1", "--gpus-per-node", "1", "--top", "1", "--json",
                 "--gpu-memory", "0.001", "--peak-tflops", "0.001", "--intra-node-GBps", "0.001",
                 "--inter-node-GBps", "0.001"])
    assert code == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["gpu"]["peak_tflops"] == 0.001


@pytest.mark.timeout(60)
def test_a_gpu_count_with_zeros_too_many_is_answered_at_once(capsys):
    """The GPUs a plan could use come from the model's splits, not from counting down from --gpus: a
    count a billion strong took minutes to refuse."""
    code = main(["plan", "configs/gpt_1.3b.yaml", "--gpus", "1000000000", "--gpus-per-node", "8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "1000000000 GPUs" in err[0] and "plan for 98304 GPUs" in err[0], err


def test_plan_notes_that_its_speeds_are_16_bit_for_an_fp32_config(capsys):
    """The presets' peaks are tensor-core bf16/fp16 figures: an fp32 run planned with them looks
    several times faster than it will be, so the plan says so (on stderr under --json, keeping its
    stdout one JSON object); a bf16 or fp16 plan has no such note."""
    argv = ["plan", "configs/gpt_1.3b.yaml", "--gpus", "1", "--gpus-per-node", "1", "--top", "1"]
    for extra, stream in (([], "out"), (["--json"], "err")):
        assert main([*argv, *extra, "--precision.dtype", "fp32"]) == 0
        captured = capsys.readouterr()
        notes = [line for line in getattr(captured, stream).splitlines() if line.startswith("note:")]
        assert len(notes) == 1 and "precision.dtype is fp32" in notes[0] and "bf16/fp16" in notes[0], captured
    json.loads(captured.out)
    for dtype in ([], ["--precision.dtype", "fp16"]):  # the config's own bf16, and fp16: both 16-bit
        assert main([*argv, *dtype]) == 0
        assert "note:" not in "".join(capsys.readouterr()), dtype


def test_plan_takes_a_config_that_names_a_zero_bubble_schedule(capsys):
    """The config's own schedule is also tried at pp 1, where there are no stage costs to time it by."""
    code = main(["plan", "configs/gpt_1.3b.yaml", "--gpus", "2", "--gpus-per-node", "2", "--gpu", "h200", "--top", "2",
                 "--parallel.pipeline_schedule", "zb-h1", "--train.global_batch_size", "64"])
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize("held, column, value", [
    (["--parallel.virtual_stages", "2"], "virtual_stages", 2),
    (["--parallel.sequence_parallel", "true"], "sequence_parallel", True),
    (["--parallel.pipeline_schedule", "interleaved_1f1b"], "schedule", "interleaved_1f1b"),
])
def test_a_held_field_needs_no_other_field_of_the_configs_own_layout(held, column, value, capsys):
    """The config's own tp 1 and pp 1 are where the search starts, not a limit on it: holding
    virtual stages, sequence parallelism or an interleaved schedule was refused up front as needing
    pp > 1 or tp > 1, though the search had such layouts to offer."""
    code = main(["plan", "configs/gpt_1.3b.yaml", "--gpus", "4", "--gpus-per-node", "4", "--top", "1000", "--json",
                 "--train.global_batch_size", "64", *held])
    assert code == 0, capsys.readouterr().err
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert rows and {r[column] for r in rows} == {value}


def test_a_held_field_the_model_refuses_is_named(capsys):
    assert main(["plan", "configs/gpt_1.3b.yaml", "--gpus", "8", "--gpus-per-node", "8", "--parallel.tp", "3"]) == 2
    assert "model.num_heads: 16 is not divisible by parallel.tp 3" in capsys.readouterr().err
