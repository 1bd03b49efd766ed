"""ZeRO stages 0-3 composed with tensor and pipeline parallelism equal single-process AdamW.

Each case builds the real engine (GPT chunks on the meta device, tensor/sequence parallel, ZeRO,
1F1B pipeline) for a layout, trains 3 steps with gradient accumulation, and compares with a
single-process GPT trained by torch's AdamW on the same global batches: the gradient norm the step
reports against the reference's, every step, to 1e-5 relative; every parameter after the last step;
the losses. Every rank's report is checked. Layouts (tp, pp, dp) run in a 4-rank and an 8-rank world:
dp 2: (2,1,2) (1,2,2) (2,2,2); dp 4: (1,1,4) (1,2,4) (2,1,4) — every value of every axis with every
ZeRO stage. Under the ``slow`` marker, in worlds of their own: the stage sweeps of (2,1,2) and
(1,2,2), whose axes (2,2,2) sweeps with every stage, two compiled cases, and stages 0 and 1 of
(1,1,4) (``SLOW_IN_4``); the 8-rank layouts (1,2,4) and (2,1,4), dp 4 beside pipelines or tensor
parallelism, whose parts the CI worlds cover apart (``SLOW_IN_8``); and the layouts (1,1,2) and
(2,2,4), in 2- and 16-rank worlds. The clipping threshold does not bind (it is still applied, with
coefficient 1), because a binding one hides a constant factor on the gradients: clipping rescales
them to the threshold and Adam normalises what remains. One case of (2,1,2) and one of (1,2,4) clip with a binding threshold.

Every case also drops its engine and checks that no parameter outlives it.

Extra cases: sequence parallel with recompute (tp 2); compiled blocks and head (tp 1, pp 1);
CPU offload (pp 2, dp 2); the interleaved schedule (two virtual stages a rank) under ZeRO 1 and 3;
splits that cut blocks in half (1F1B, ZB-H1, interleaved);
the Llama preset (rotary, RMSNorm, SwiGLU, grouped key/value heads, untied head) through tensor
and pipeline parallelism; the ``tp-pp-dp`` rank order. Tolerance: fp32, parameters within 5e-6
absolute after 3 steps of lr 1e-2 (under 2e-4 of the update; unclipped gradients leave more of
the rounding to Adam than clipped ones did, measured up to 3e-6), losses and norms within 1e-5
relative; Adam epsilon 1e-4 (see EPS).

Planted bug this caught that the former binding-clip, parameters-only version missed: gradients
not divided by the data-parallel size (a constant factor of dp). Two more planted bugs fail both
versions: the tied embedding's gradient summed twice across pipeline stages, and the norm counting
tensor-replicated parameters on every tensor rank.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from megazero.config import load_config
from megazero.engine import Engine
from parallel.tensor_parallel.sharding import param_shards
from parallel.topology import RankGrid, Topology
from tests.distributed import run_world
from tests.reference import train_reference

STEPS, MICRO_BATCH, MICROS_PER_RANK, SEQ, VOCAB = 3, 2, 2, 8, 61
CLIP = 1e3  # never binds: the gradient norms here are about 1
BINDING_CLIP = 0.5
PARAM_TOL = 5e-6
# The key bias gets a gradient that is zero in exact arithmetic (softmax ignores a shift shared by all
# keys), so its float value is rounding noise, which Adam with a tiny epsilon would blow up to full-size
# updates of arbitrary sign in any two implementations. An epsilon far above that noise (and far below
# the real gradients, ~1e-2) keeps the comparison about the parallel math.
EPS = 1e-4
LAYOUTS = {4: [(2, 1, 2), (1, 2, 2), (1, 1, 4)], 8: [(2, 2, 2), (1, 2, 4), (2, 1, 4)],
           # the rest of the matrix, under the slow marker: (1,1,2) and (2,2,4)
           2: [(1, 1, 2)], 16: [(2, 2, 4)]}
# Parts of the 4-rank world's matrix that run under the slow marker, in a 4-rank world of their own:
# the stage sweeps of layouts whose axes the 8-rank world sweeps with every stage, and two of the
# three compiled cases (compiling on four ranks of two cores, with a cold cache as on a fresh
# machine, took over half the world's time; the sequence-parallel compiled case stays), and stages 0
# and 1 of pure data parallelism (1,1,4), which the toy ZeRO world sweeps at dp 4 with every stage.
SLOW_IN_4 = {(2, 1, 2, stage) for stage in (0, 1, 2, 3)} | {(1, 2, 2, stage) for stage in (0, 1, 2, 3)} \
    | {(2, 1, 2, "recompute+compile"), (1, 1, 4, "compile"), (1, 1, 4, 0), (1, 1, 4, 1)}
# Layouts of the 8-rank world that run under the slow marker, in an 8-rank world of their own (kept
# the CI run under its time: the world took 98 s of two cores).
SLOW_IN_8 = {(1, 2, 4), (2, 1, 4)}


def _slow(world_size, tp, pp, dp, name) -> bool:
    """Whether a case of a 4- or 8-rank world belongs to its slow part."""
    return (tp, pp, dp, name) in SLOW_IN_4 if world_size == 4 else (tp, pp, dp) in SLOW_IN_8 if world_size == 8 \
        else False


LLAMA = ("--model.preset", "llama", "--model.num_kv_heads", "2")


def _config(tp, pp, dp, stage, extra=()):
    overrides = ["--model.preset", "gpt2", "--model.num_layers", "4", "--model.hidden_size", "32",
                 "--model.num_heads", "4", "--model.vocab_size", str(VOCAB), "--model.seq_length", str(SEQ),
                 "--parallel.tp", str(tp), "--parallel.pp", str(pp), "--parallel.dp", str(dp),
                 "--zero.stage", str(stage), "--zero.bucket_size_mb", "0.002",
                 "--train.micro_batch_size", str(MICRO_BATCH),
                 "--train.global_batch_size", str(MICRO_BATCH * MICROS_PER_RANK * dp),
                 "--optimizer.lr", "1e-2", "--optimizer.min_lr", "0", "--optimizer.eps", str(EPS), "--optimizer.clip_grad", str(CLIP),
                 "--train.seed", "5", "--train.device", "cpu", *extra]
    return load_config(None, overrides)


def _batches(step, dp):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (dp * MICROS_PER_RANK, MICRO_BATCH, SEQ + 1), generator=g)
    return [{"tokens": t[:, :-1], "labels": t[:, 1:]} for t in tokens]


def _reference(cfg, dp):
    return train_reference(cfg, lambda step: _batches(step, dp), STEPS)


def _case(topo, tp, pp, dp, stage, extra=()):
    # Everything alive now outlives the case (modules, torch's compile caches): frozen, the collection
    # below scans only what the case made, which cut it from 0.8 s to a blink. A leak into an older
    # object still keeps the engine's parameters alive: the older object's reference is outside the scan.
    gc.freeze()
    cfg = _config(tp, pp, dp, stage, extra)
    engine = Engine(cfg, topo, torch.device("cpu"))
    losses, norms = [], []
    for step in range(STEPS):
        batches = _batches(step, dp)
        mine = batches[topo.dp_rank * MICROS_PER_RANK:(topo.dp_rank + 1) * MICROS_PER_RANK]
        out = engine.train_step(mine, lr=1e-2)
        losses.append(out.loss)
        norms.append(out.result.grad_norm)
    engine.data_parallel.wait_params()
    result = _compare(engine, cfg, dp, losses, norms)
    result["reduces"] = (stage, pp, engine.data_parallel.reducer.mode)
    held = [weakref.ref(p) for chunk in engine.chunks for p in chunk.parameters()]
    del engine
    gc.collect()
    result["kept_after_drop"] = sum(ref() is not None for ref in held)
    return result


def _compare(engine, cfg, dp, losses, norms):
    """The trained engine's parameters, losses and gradient norms against the single-process reference."""
    reference, ref_losses, ref_norms = _reference(cfg, dp)
    ref = dict(reference.named_parameters())
    worst, worst_name = 0.0, None
    for chunk in engine.chunks:
        shards = param_shards(chunk)
        for name, p in chunk.named_parameters():
            expect = ref["embedding.tokens.weight" if name == "lm_head.weight" and name not in ref else name].detach()
            expect = shards[name].take(expect) if name in shards else expect
            err = (p.detach() - expect).abs().max().item()
            if err > worst:
                worst, worst_name = err, name
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    norm_err = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
    return {"param_err": worst, "loss_err": loss_err, "norm_err": norm_err, "worst": worst_name,
            "norms": norms, "ref_norms": ref_norms}


def _world(rank, world_size, slow_part=False):
    """Every case of ``world_size``'s layouts; at 4 and 8 ranks, those of the slow part
    (``slow_part``) or the others."""
    torch.manual_seed(0)
    out = {}
    for tp, pp, dp in LAYOUTS[world_size]:
        topo = Topology(RankGrid(tp=tp, pp=pp, dp=dp))
        cases = [(stage, stage, ()) for stage in (0, 1, 2, 3)] + list(_extras(tp, pp, dp))
        for name, stage, extra in cases:
            if _slow(world_size, tp, pp, dp, name) == slow_part:
                out[(tp, pp, dp, name)] = _case(topo, tp, pp, dp, stage, extra)
    if world_size == 8 and not slow_part:
        order = ("--parallel.order", "tp-pp-dp")
        topo = Topology(RankGrid(tp=2, pp=2, dp=2, order="tp-pp-dp"))
        out[(2, 2, 2, "tp-pp-dp")] = _case(topo, 2, 2, 2, 2, order)
        out[(2, 2, 2, "tp-pp-dp interleaved llama")] = _case(
            topo, 2, 2, 2, 1, (*order, *LLAMA, "--parallel.virtual_stages", "2"))
    return out


def _extras(tp, pp, dp):
    """(name, stage, overrides) of the cases beyond the plain stage sweep for one layout."""
    if tp == 2:
        yield "sp+recompute", 3, ("--parallel.sequence_parallel", "true", "--parallel.recompute", "full")
    if (tp, pp) == (1, 1):
        # compiled blocks and head+loss, with stage 3 regathering the tied head around them
        yield "compile", 3, ("--train.compile", "true")
    if (tp, pp, dp) == (1, 1, 4):
        # a split backward without a pipeline: the weight gradients come after the unit's backward,
        # so stage 3 keeps its parameters gathered for the step (it read a released one and failed)
        yield "zb-h1", 3, ("--parallel.pipeline_schedule", "zb-h1")
    if (tp, pp, dp) == (2, 1, 2):
        # compiled blocks holding the overlapped sequence-parallel linears as custom ops
        yield "sp+compile", 1, ("--parallel.sequence_parallel", "true", "--train.compile", "true")
        # compiled blocks recomputed whole, their all-reduces inside the checkpoint
        yield "recompute+compile", 1, ("--parallel.recompute", "full", "--train.compile", "true")
        # the linears' serial communication mode (the default overlaps)
        yield "sp serial", 2, ("--parallel.sequence_parallel", "true", "--parallel.tp_comm", "serial")
        # a split backward without a pipeline, the embedding its own head: the lookup's gradient comes
        # in the backward, the vocab-parallel head's in the deferred weight pass after it (its bucket,
        # reduced when the first arrived, dropped the second: gradient norms 8% off)
        yield "zb-h1 tied", 1, ("--parallel.pipeline_schedule", "zb-h1")
    if pp == 2 and dp == 2:
        # the offloaded update applied unit by unit from the pipeline chunks' hooks
        yield "offload", 1 + tp, ("--zero.offload_optimizer", "true")
    if (tp, pp, dp) == (1, 2, 2):
        for stage in (1, 3):
            yield f"interleaved {stage}", stage, ("--parallel.virtual_stages", "2")
        # a block cut between its attention (stage 0) and its MLP (stage 1), under 1F1B and under
        # ZB-H1's deferred weight gradients; then halves in two chunks a rank, on the Llama preset
        yield "half block", 3, ("--parallel.pipeline_split", "[1.5, 2.5]")
        yield "half block zb-h1", 1, ("--parallel.pipeline_split", "[2.5, 1.5]", "--parallel.pipeline_schedule", "zb-h1")
        # half blocks recomputed: whole, and the attention core alone (which an MLP half does not have)
        for mode in ("full", "selective"):
            yield f"half block recompute {mode}", 1, ("--parallel.pipeline_split", "[1.5, 2.5]",
                                                      "--parallel.recompute", mode)
        yield "half blocks interleaved llama", 2, (*LLAMA, "--parallel.virtual_stages", "2",
                                                   "--parallel.pipeline_split", "[0.5, 1.5, 1.5, 0.5]")
    if (tp, pp, dp) == (2, 2, 2):  # a half block under sequence parallelism: the hidden state sent is a token chunk
        yield "sp half block", 1, ("--parallel.sequence_parallel", "true", "--parallel.pipeline_split", "[2.5, 1.5]")
    if (tp, pp, dp) in ((2, 1, 2), (1, 2, 2)):  # the untied head through tensor and pipeline parallelism
        yield "llama", 1 + tp, LLAMA
    if (tp, pp, dp) in ((2, 1, 2), (1, 2, 4)):
        yield "binding clip", 2, ("--optimizer.clip_grad", str(BINDING_CLIP))


def _part(param) -> tuple[int, bool]:
    """(world size, slow part) of a world fixture's parameter: 4, "4-slow", ..."""
    return (int(param.split("-")[0]), True) if isinstance(param, str) else (param, False)


@pytest.fixture(scope="module", params=[4, 8, pytest.param("4-slow", marks=pytest.mark.slow),
                                        pytest.param("8-slow", marks=pytest.mark.slow),
                                        pytest.param(2, marks=pytest.mark.slow),
                                        pytest.param(16, marks=pytest.mark.slow)])
def world(request):
    world_size, slow_part = _part(request.param)
    reports = run_world(world_size, _world, slow_part, timeout=600)
    return request.param, reports


def _expected_cases(part):
    world_size, slow_part = _part(part)
    layouts = LAYOUTS[world_size]
    cases = {(*layout, stage) for layout in layouts for stage in (0, 1, 2, 3)}
    cases |= {(*layout, name) for layout in layouts for name, _, _ in _extras(*layout)}
    cases = {case for case in cases if _slow(world_size, *case) == slow_part}
    if world_size == 8 and not slow_part:
        cases |= {(2, 2, 2, "tp-pp-dp"), (2, 2, 2, "tp-pp-dp interleaved llama")}
    return cases


def test_every_layout_and_stage_matches_single_process(world):
    part, reports = world
    for rank, report in enumerate(reports):
        assert set(report) == _expected_cases(part), rank
        for key, value in report.items():
            assert value["param_err"] < PARAM_TOL, (rank, key, value)
            assert value["loss_err"] < 1e-5, (rank, key, value)


def test_a_pipeline_reduces_zero_2_and_3_gradients_once_a_step(world):
    """Under a pipeline or a split-backward (zero-bubble) schedule, stages 2 and 3 keep whole gradients
    across the micro-batches and reduce them once a step (``once_per_step``); reducing them after
    every backward gives the same numbers with a reduction per micro-batch, so only the mode can
    show it. Otherwise they reduce each backward. (Planted: the engine not asking for the
    once-a-step mode, which an untied model at pp > 1 ran without any error.)"""
    _, reports = world
    for rank, report in enumerate(reports):
        for key, value in report.items():
            stage, pp, mode = value["reduces"]
            split = "zb" in str(key[-1])
            assert mode == ("sharded" if stage >= 2 and pp == 1 and not split else "full"), (rank, key, mode)


def test_reported_gradient_norm_equals_the_reference_every_step(world):
    world_size, reports = world
    for rank, report in enumerate(reports):
        for key, value in report.items():
            assert value["norm_err"] < 1e-5, (rank, key, value["norms"], value["ref_norms"])


def test_a_dropped_engine_frees_its_model(world):
    """Parameter hooks live on the C++ side, out of the garbage collector's sight: one that holds its
    reducer strongly kept every dropped engine's model, gradient buffers and optimizer state alive."""
    world_size, reports = world
    for rank, report in enumerate(reports):
        for key, value in report.items():
            assert value["kept_after_drop"] == 0, (rank, key, value["kept_after_drop"])


def test_clipping_binds_only_where_meant(world):
    world_size, reports = world
    for rank, report in enumerate(reports):
        for key, value in report.items():
            threshold = BINDING_CLIP if key[3] == "binding clip" else CLIP
            assert all((n > threshold) == (key[3] == "binding clip") for n in value["ref_norms"]), (rank, key)
