"""How the planner's search picks among layouts: the nearest layout that fits changes the fewest
knobs, the config's own micro-batch size, schedule and tensor-parallel size are searched beside the
usual ones, and a layout fits when it needs exactly the device's memory."""

import dataclasses

import pytest

from megazero.config import load_config, resolve_config
from megazero.planner import GPUS, Cluster, estimate_memory, plan
from megazero.planner.fit import memory_problem
from megazero.planner.hardware import GIB, custom_gpu
from megazero.planner.search import evaluate, layout_of, nearest_fitting


def small(*overrides, world=2):
    """A 4-block GPT of width 256 over 512-token samples on 2 GPUs (or ``world``): its activations dominate."""
    return resolve_config(load_config(None, [
        "--model.num_layers", "4", "--model.hidden_size", "256", "--model.num_heads", "4", "--model.seq_length", "512",
        "--model.vocab_size", "512", "--precision.dtype", "bf16", *overrides]), world, world)


def test_the_nearest_fitting_layout_changes_fewest_knobs_before_it_is_fastest():
    """At 97% of what its own layout needs, ZeRO 0 at micro-batch 8 does not fit. The fastest layouts
    that do change several knobs. Halving the micro-batch alone fits, and so does full recompute alone;
    the start-up check names the faster of the two single changes: recompute, since this small model's
    micro-batches cost mostly their fixed part, which halving the micro-batch would double."""
    cfg = small("--train.micro_batch_size", "8", "--train.global_batch_size", "16", "--zero.stage", "0")
    own = layout_of(cfg)
    cluster = Cluster(custom_gpu(GPUS["h100"], memory_gib=0.97 * estimate_memory(cfg).needed / GIB), 2, 2)
    fastest = next(c for c in plan(cfg, cluster) if c.fits)
    assert len(fastest.layout.changes_from(own)) >= 2
    single = {tuple(c.layout.changes_from(own)) for c in plan(cfg, cluster) if c.fits}
    assert {("--train.micro_batch_size 4",), ("--parallel.recompute full",)} <= single
    assert nearest_fitting(cfg, cluster).layout.changes_from(own) == ["--parallel.recompute full"]


@pytest.mark.parametrize("overrides", [["--train.micro_batch_size", "3", "--train.global_batch_size", "6"],
                                       ["--parallel.pipeline_schedule", "gradient_accumulation"]])
def test_the_configs_own_values_are_searched_beside_the_usual_ones(overrides):
    """A micro-batch of 3 beside the powers of two, a schedule named for one pipeline stage beside
    auto: the config's own layout is always among those ranked."""
    cfg = small(*overrides)
    assert layout_of(cfg) in {c.layout for c in plan(cfg, Cluster(GPUS["h100"], 2, 2))}


def test_the_configs_own_tensor_parallel_size_is_searched_beside_the_powers_of_two():
    """tp 3 on a node of 3 (6 heads of width 32, an MLP of 768): not a power of two, but a layout the
    trainer accepts, so the plan ranks it, and a plan holding it (`--parallel.tp 3`) has rows."""
    cfg = resolve_config(load_config(None, [
        "--model.num_layers", "4", "--model.hidden_size", "192", "--model.num_heads", "6", "--model.seq_length", "512",
        "--model.vocab_size", "512", "--precision.dtype", "bf16", "--parallel.tp", "3",
        "--train.global_batch_size", "8"]), 3, 3)
    ranked = plan(cfg, Cluster(GPUS["h100"], 3, 3))
    assert layout_of(cfg) in {c.layout for c in ranked}
    assert {c.layout.tp for c in ranked} == {1, 3}


def test_a_layout_needing_exactly_the_devices_memory_fits():
    """The planner's search and the start-up memory check both fit a layout whose need equals the memory."""
    cfg = small("--train.micro_batch_size", "8", "--train.global_batch_size", "16")
    needed = estimate_memory(cfg).needed / GIB
    assert evaluate(cfg, Cluster(custom_gpu(GPUS["h100"], memory_gib=needed), 2, 2)).fits
    # the start-up check agrees: a stated budget of exactly what the run needs raises nothing
    assert memory_problem(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, memory_budget_gib=needed))) is None


def test_among_equally_fast_layouts_the_configs_own_knobs_lead():
    """On one GPU every ZeRO stage runs as fast (nothing to shard over), so the config's own stage 2
    leads the plan, though stages 0 and 1 need a little less memory (planted: ties broken by memory
    alone, passed)."""
    ranked = plan(small("--zero.stage", "2", world=1), Cluster(GPUS["h100"], 1, 1))
    assert {c.layout.zero_stage for c in ranked if c.step.step_s == ranked[0].step.step_s} == {0, 1, 2, 3}
    assert ranked[0].layout.zero_stage == 2 and ranked[1].memory.needed < ranked[0].memory.needed


def test_among_equally_near_and_fast_fitting_layouts_the_one_using_the_most_memory_is_named():
    """One GPU at just under what ZeRO 2 needs there: stages 0, 1 and 3 each fit with one change and run
    as fast; the start-up check names stage 3, the smallest step back from what was asked."""
    cfg = small("--zero.stage", "2", "--train.micro_batch_size", "16", "--train.global_batch_size", "16", world=1)
    budget = 0.999 * estimate_memory(cfg).needed / GIB
    nearest = nearest_fitting(cfg, Cluster(custom_gpu(GPUS["h100"], memory_gib=budget), 1, 1))
    assert nearest.layout.changes_from(layout_of(cfg)) == ["--zero.stage 3"]


def test_zb_v_is_planned_only_where_the_config_names_it():
    """ZB-V's equal-cost bubble is half ZB-H1's, yet it ran slower than ZB-H2 on H200s: the search tries
    it only for a config that names it, beside the other zero-bubble schedules it tries for any pipeline."""
    cluster = Cluster(GPUS["h100"], 2, 2)
    searched = {c.layout.schedule for c in plan(small("--train.global_batch_size", "8"), cluster)}
    assert {"zb-h1", "zb-h2"} <= searched and "zb-v" not in searched
    named = small("--train.global_batch_size", "8", "--parallel.pipeline_schedule", "zb-v", "--parallel.pp", "2",
                  "--parallel.virtual_stages", "2")
    assert "zb-v" in {c.layout.schedule for c in plan(named, cluster)}


def test_a_step_time_equal_but_for_its_last_bit_ranks_the_configs_own_knobs_first():
    """The demo config on eight H100s: layouts whose predicted steps differ only in the last bits of a
    float (the same terms summed in another order) are equally fast, so among them the layout that
    changes fewer of the config's knobs ranks first. Ranked by the raw float, 77 neighbouring pairs
    put more changes first."""
    cfg = load_config("configs/demo.yaml")
    fitting = [c for c in plan(cfg, Cluster(GPUS["h100"], 8, 8)) if c.fits]
    own = layout_of(cfg)
    ties = [(a, b) for a, b in zip(fitting, fitting[1:]) if a.step.step_s != b.step.step_s
            and a.step.step_s == pytest.approx(b.step.step_s, rel=1e-12)]
    assert ties  # the case exists
    assert all(len(a.layout.changes_from(own)) <= len(b.layout.changes_from(own)) for a, b in ties)
