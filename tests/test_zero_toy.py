"""ZeRO stages 0-3 equal single-process AdamW on a small model, on real gloo groups of 2 and 4.

The model is a stack of residual blocks between a tied embedding and head, small enough that
each rank also computes the single-process reference itself. Buckets are tiny (a few hundred
elements), so parameters straddle buckets and every path of the bucketing is exercised.
Tolerance: fp32, parameters after 3 steps within 2e-6 absolute (Adam's first steps move each
weight by about lr = 1e-2, so this is ~1e-4 of the update).
"""

import copy

import pytest
import torch
import torch.distributed as dist

from megazero.zero import DynamicLossScaler, ZeroOptimizer, ZeroSettings
from tests.distributed import run_world

STEPS, MICRO, BATCH, VOCAB, WIDTH = 3, 2, 4, 50, 24
TOL = 2e-6
# Gradients accumulated and reduced in bf16 (8 bits of mantissa): Adam turns the rounding of
# near-zero gradients into full-size updates of either sign, so those runs are checked by the
# relative error of the whole update (parameters minus initial values) against the fp32 reference.
BF16_GRAD_TOL = 0.05


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.fc = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.proj = torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.proj(torch.nn.functional.gelu(self.fc(self.norm(x))))


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.norm = torch.nn.LayerNorm(WIDTH)

    def forward(self, tokens, labels, skip=None):
        """``skip``: index of a block left out, so its parameters get no gradient that step."""
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            if i != skip:
                x = block(x)
        logits = self.norm(x) @ self.embed.weight.t()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _data(step, index):
    g = torch.Generator().manual_seed(1000 * step + index)
    tokens = torch.randint(0, VOCAB, (BATCH, 8), generator=g)
    return tokens, torch.roll(tokens, -1, 1)


def _skipped(variant, step):
    """The "unused" variant leaves block 1 out of step 1: stale gradients must not leak into it."""
    return 1 if variant == "unused" and step == 1 else None


def _reference(model, steps, batches_per_step, clip, variant="plain"):
    model = copy.deepcopy(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for step in range(steps):
        opt.zero_grad(set_to_none=False)  # an unused parameter steps with a zero gradient, as in ZeRO
        for index in range(batches_per_step):
            (model(*_data(step, index), skip=_skipped(variant, step)) / batches_per_step).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model


CASES = [(stage, variant) for stage in (0, 1, 2, 3) for variant in ("plain", "overlap")] + [
    (2, "once_per_step"), (3, "once_per_step"), (3, "prefetch2"), (3, "persist"), (1, "offload"), (3, "offload"),
    (0, "offload"), (1, "offload+overlap"), (2, "offload+overlap"),
    (0, "bf16grads"), (1, "bf16grads"), (2, "bf16grads"), (3, "bf16grads"),
    (0, "unused"), (1, "unused"), (2, "unused"), (3, "unused")]


def _zero_run(rank, world_size):
    torch.manual_seed(0)
    base = Toy()
    results = {}
    for dp in (2, 4):
        groups = [dist.new_group(list(range(s, s + dp))) for s in range(0, world_size, dp)]
        group = groups[rank // dp]
        dp_rank = rank % dp
        for clip in (1e9, 0.05):
            references = {v: _reference(base, STEPS, MICRO * dp, clip, v) for v in ("plain", "unused")}
            for stage, variant in CASES:
                model = copy.deepcopy(base)
                settings = ZeroSettings(stage=stage, bucket_numel=320, lr=1e-2, clip_grad=clip,
                                        once_per_step=variant == "once_per_step",
                                        prefetch_depth=2 if variant == "prefetch2" else 1,
                                        persistence_threshold=100 if variant == "persist" else 0,
                                        offload=variant.startswith("offload"),
                                        grad_dtype=torch.bfloat16 if variant == "bf16grads" else torch.float32)
                opt = ZeroOptimizer(model, settings, group, None, units=list(model.blocks))
                norms = []
                for step in range(STEPS):
                    for micro in range(MICRO):
                        opt.begin_microbatch(last=variant.endswith("overlap") and micro == MICRO - 1)
                        loss = model(*_data(step, dp_rank * MICRO + micro), skip=_skipped(variant, step)) / MICRO
                        opt.scale_loss(loss).backward()
                    norms.append(opt.step().grad_norm)
                opt.wait_params()
                reference = references["unused" if variant == "unused" else "plain"]
                pairs = list(zip(model.state_dict().values(), reference.state_dict().values(),
                                 base.state_dict().values()))
                if variant == "bf16grads":  # relative error of the whole update, see BF16_GRAD_TOL
                    err = (torch.stack([(p - q).norm() for p, q, _ in pairs]).norm()
                           / torch.stack([(q - p0).norm() for _, q, p0 in pairs]).norm()).item()
                else:
                    err = max((p - q).abs().max().item() for p, q, _ in pairs)
                results[(dp, clip, stage, variant)] = (err, norms)
        results.update(_memory_and_overflow(base, group, dp, dp_rank))
    return results


def _memory_and_overflow(base, group, dp, dp_rank):
    """Bytes held per category against the formula; an inf on one rank skips the step everywhere."""
    out = {}
    for stage in (0, 1, 2, 3):
        for grad_dtype in (torch.float32, torch.bfloat16):
            model = copy.deepcopy(base)
            opt = ZeroOptimizer(model, ZeroSettings(stage=stage, bucket_numel=320, param_dtype=torch.bfloat16,
                                                    grad_dtype=grad_dtype), group, None, units=list(model.blocks))
            predicted = opt.predicted_memory()
            out[("memory", dp, stage, grad_dtype)] = (opt.memory_bytes(), {
                k: getattr(predicted, k) for k in ("params", "grads", "master", "optimizer")})
    model = copy.deepcopy(base)
    opt = ZeroOptimizer(model, ZeroSettings(stage=2, bucket_numel=320, lr=1e-2,
                                            loss_scaler=DynamicLossScaler(initial_scale=1024, hysteresis=1)),
                        group, None, units=list(model.blocks))
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(*_data(0, dp_rank))
    if dp_rank == dp - 1:
        loss = loss * float("inf")
    opt.scale_loss(loss).backward()
    result = opt.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    out[("overflow", dp)] = (result.skipped, opt.scaler.scale, unchanged)
    return out


@pytest.fixture(scope="module")
def zero_world():
    return run_world(4, _zero_run)


@pytest.fixture(scope="module")
def zero_results(zero_world):
    return zero_world[0]


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("clip", [1e9, 0.05])
@pytest.mark.parametrize("stage, variant", CASES)
def test_zero_matches_single_process_adamw(zero_results, dp, clip, stage, variant):
    err, norms = zero_results[(dp, clip, stage, variant)]
    assert err < (BF16_GRAD_TOL if variant == "bf16grads" else TOL), f"parameter error {err:.3g} (max absolute; relative update for bf16 gradients)"
    if clip < 1:
        assert all(n > clip for n in norms), "the clipping threshold must bind in this case"


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_memory_held_equals_zero_formula(zero_world, dp, stage, grad_dtype):
    for rank_results in zero_world:
        measured, predicted = rank_results[("memory", dp, stage, grad_dtype)]
        assert measured == pytest.approx(predicted, abs=0), (measured, predicted)


@pytest.mark.parametrize("dp", [2, 4])
def test_overflow_on_one_rank_skips_everywhere(zero_world, dp):
    for rank_results in zero_world:
        skipped, scale, unchanged = rank_results[("overflow", dp)]
        assert skipped and unchanged and scale == 512.0
