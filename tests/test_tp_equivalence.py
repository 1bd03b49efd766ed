"""Tensor parallelism computes the single-process model: one 4-rank gloo world, every layout.

Each rank builds the plain model (the reference) and, for every case, the tensor-parallel model
(tp 1, 2 or 4 with data parallelism filling the world; sequence parallelism in the serial and the
overlapped communication mode), runs forward and backward on the same batch, gathers logits and
every parameter gradient back to full shape and reports the largest relative difference:
max|tp - ref| / max|ref|. Tolerance: fp32, RTOL = 1e-5. No case builds the very model
it is compared with (``test_no_case_compares_the_reference_with_itself``).
"""

import itertools

import pytest
import torch
import torch.distributed as dist

from models import GPT
from models.config import ModelConfig
from models.parallelize import tensor_parallelize_gpt
from parallel.tensor_parallel.partial_grads import sum_partial_grads
from parallel.tensor_parallel.random import TensorParallelRNG
from models.presets import MODEL_PRESETS
from parallel.tensor_parallel.sharding import param_shards
from parallel.topology import RankGrid, Topology
from tests.distributed import run_world

RTOL = 1e-5
SEED = 11
WORLD = 4
TPS = (1, 2, 4)
PRESETS = ("gpt2", "llama")
VARIANTS = [  # (sequence parallelism: False or its communication mode, recompute, meta-device build)
    (False, "none", False),
    ("serial", "none", False),
    ("overlap", "none", True),
    (False, "full", True),
    ("overlap", "selective", False),
    ("overlap", "full", False),
    (False, "selective", True),
]
# Sequence parallelism is dropped at tp 1. There the plain variant builds exactly the reference model,
# so it would compare the model with itself: every tp 1 case takes another code path (recompute or the
# meta-device build).
CASES = [(p, tp, sp if tp > 1 else False, rc, meta)
         for p, tp, (sp, rc, meta) in itertools.product(PRESETS, TPS, VARIANTS) if tp > 1 or rc != "none" or meta]


def config(preset: str) -> ModelConfig:
    fields = dict(MODEL_PRESETS[preset], num_layers=3, hidden_size=64, num_heads=8, vocab_size=300,
                  seq_length=16, init_std=0.05)
    if preset == "llama":
        fields["num_kv_heads"] = 4
    return ModelConfig(**fields)


def batch(cfg: ModelConfig):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    labels[1, 5:9] = -100
    # the last id of a vocabulary shard and the first of the next (shards of 256 rows at tp 2, 128 at
    # tp 4): an embedding whose range check let its first row past the end through would index out of it
    ids[0, :4] = torch.tensor([127, 128, 255, 256])
    return ids, labels


def run(model, cfg):
    """Logits, and the loss per token and summed; gradients come from the sum, as in training."""
    ids, labels = batch(cfg)
    with torch.no_grad():
        logits, per_token = model(ids), model(ids, labels)
    total = model(ids, labels, reduction="sum")
    (total / (labels != -100).sum()).backward()
    return logits, (per_token, total.detach())


def gather(local: torch.Tensor, shard, group, dim=None) -> torch.Tensor:
    """The full tensor from every rank's ``shard`` (along ``dim`` if given, else the shard's own)."""
    if shard is None:
        return local
    parts = [torch.empty_like(local) for _ in range(shard.count)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=shard.dim if dim is None else dim)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _equivalence(rank, world_size):
    topologies = {tp: Topology(RankGrid(tp=tp, pp=1, dp=world_size // tp)) for tp in TPS}
    references = {}
    for preset in PRESETS:
        cfg = config(preset)
        torch.manual_seed(0)
        ref = GPT(cfg, seed=SEED)
        logits, loss = run(ref, cfg)
        references[preset] = (logits, loss, {n: (p.detach(), p.grad) for n, p in ref.named_parameters()})
    report = {}
    for case in CASES:
        preset, tp, sp, recompute, meta = case
        cfg, group = config(preset), topologies[tp].tp_group
        model = GPT(cfg, vocab_multiple=128 * tp, seed=SEED, device="meta" if meta else "cpu")
        tensor_parallelize_gpt(model, group, seed=SEED, sequence_parallel=bool(sp), tp_comm=sp or "overlap",
                               recompute=recompute, recompute_every=2)
        # the stream of this tp rank's seed: the same on every data-parallel replica
        tp_stream = tp == 1 or torch.equal(model.tp_rng.state, TensorParallelRNG(SEED, topologies[tp].tp_rank).state)
        if meta:
            model.to_empty(device="cpu")
            model.init_weights(SEED)
        torch.manual_seed(0)
        logits, loss = run(model, cfg)
        sum_partial_grads(model, group)
        ref_logits, ref_loss, ref_params = references[preset]
        shards = param_shards(model)
        full_logits = gather(logits, shards.get("lm_head.weight"), group, dim=-1)
        out = {"logits": rel(full_logits[..., :cfg.vocab_size], ref_logits[..., :cfg.vocab_size]),
               "loss": max(rel(a, b) for a, b in zip(loss, ref_loss)),
               "grads": {}, "weights": {}, "layout": {}, "padding_grad": 0.0,
               "tp_stream": tp_stream, "comm": {m.comm_mode for m in model.modules() if hasattr(m, "comm_mode")}}
        for name, param in model.named_parameters():
            shard = shards.get(name)
            weight, grad = gather(param.detach(), shard, group), gather(param.grad, shard, group)
            ref_weight, ref_grad = ref_params[name]
            if name in ("embedding.tokens.weight", "lm_head.weight"):
                out["padding_grad"] = max(out["padding_grad"], grad[cfg.vocab_size:].abs().max().item())
                weight, grad = weight[:cfg.vocab_size], grad[:cfg.vocab_size]
                ref_weight, ref_grad = ref_weight[:cfg.vocab_size], ref_grad[:cfg.vocab_size]
            out["grads"][name] = rel(grad, ref_grad)
            out["weights"][name] = rel(weight, ref_weight)
            out["layout"][name] = (tuple(param.shape), None if shard is None else shard.dim,
                                   tuple(ref_params[name][0].shape), model.padded_vocab)
        report[case] = out
    return report


@pytest.fixture(scope="module")
def reports():
    return run_world(WORLD, _equivalence)


def ids(case):
    preset, tp, sp, recompute, meta = case
    return f"{preset}-tp{tp}{f'-sp-{sp}' if sp else ''}-{recompute}{'-meta' if meta else ''}"


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_logits_and_loss_match_single_process(reports, case):
    for report in reports:
        assert report[case]["logits"] <= RTOL
        assert report[case]["loss"] <= RTOL


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_every_parameter_gradient_matches(reports, case):
    preset = case[0]
    expected = {n for n, _ in GPT(config(preset), device="meta").named_parameters()}
    for report in reports:
        assert set(report[case]["grads"]) == expected
        bad = {n: e for n, e in report[case]["grads"].items() if e > RTOL}
        assert not bad, bad
        assert report[case]["padding_grad"] == 0.0


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_initial_weights_do_not_depend_on_the_layout(reports, case):
    for report in reports:
        assert max(report[case]["weights"].values()) == 0.0


@pytest.mark.parametrize("case", [c for c in CASES if c[1] > 1], ids=ids)
def test_each_rank_holds_a_tp_th_of_sharded_weights_and_all_of_the_rest(reports, case):
    tp = case[1]
    sharded = {"embedding.tokens.weight", "lm_head.weight"}
    for report in reports:
        layout = report[case]["layout"]
        for name, (local, dim, ref_shape, padded_vocab) in layout.items():
            full = list(ref_shape)
            if name in sharded:
                full[0] = padded_vocab
            if name.endswith(("qkv.weight", "qkv.bias", "fc_in.weight", "fc_in.bias", "out.weight", "fc_out.weight")) \
                    or name in sharded:
                assert dim is not None, name
                expect = list(full)
                expect[dim] //= tp
                assert list(local) == expect, name
            else:
                assert dim is None and list(local) == full, name


@pytest.mark.parametrize("case", [c for c in CASES if c[1] > 1], ids=ids)
def test_the_linears_communicate_in_the_mode_asked_for(reports, case):
    """Serial and overlapped communication compute the same sums, so equal results cannot show that
    the mode asked for reached the layers; a mode dropped on the way would go unnoticed."""
    for report in reports:
        assert report[case]["comm"] == {case[2] or "overlap"}


def test_the_tp_stream_is_seeded_by_the_tensor_parallel_rank(reports):
    """Not by the global rank: data-parallel replicas (ranks 2 and 3 at tp 2) would then draw other
    tp-stream masks than replica 0, and a run's masks would change with its data-parallel size."""
    for report in reports:
        assert all(report[case]["tp_stream"] for case in CASES if case[1] > 1)


def test_no_case_compares_the_reference_with_itself():
    plain_at_tp1 = [c for c in CASES if c[1] == 1 and c[3] == "none" and not c[4]]
    assert not plain_at_tp1
    assert {c[0] for c in CASES if c[1] == 1} == set(PRESETS)
