"""ShardedAdamW on a world of one rank against torch's AdamW, step by step: the optimizer's own
math (decay groups, clipping, the scheduled learning rate, skipping, the dynamic loss scale, the
offloaded update, a resumed step count) without the 4-rank world of ``tests/test_zero_toy.py``.

It trains the toy model of ``tests/toy.py`` against its reference. With one rank the shard is the
whole model, so the first moments are compared element by element too: Adam's normalised update
hides a constant factor on the gradients from the parameters, not from the moments. One process: a world of 1 (``run_world(1, ...)``).
"""

import copy
import traceback

import pytest
import torch
import torch.distributed as dist

from megazero.optim import STATE_KEYS, DynamicLossScaler
from parallel.data_parallel.storage import holds_storage
from tests.distributed import run_world
from tests.sharded import sharded_adamw
from tests.toy import STEPS, Toy, _data, _first_moments, _lr, _reference

TOL = 2e-6
MOMENT_TOL = 1e-5  # relative, over all moments
# fp16 gradients: where this run's fp32 gradient and the reference's differ in the last bit, rounding
# to fp16 can part them by a whole fp16 step (1e-3 relative). Measured 1.8e-6 (parameters) and 4.4e-6
# (moments); rounded through bf16 on the way to the master instead, 5.9e-5 and 1.1e-3.
FP16_GRAD_TOLS = (1e-5, 1e-4)


def _relative(got, want):
    """Relative error of the first moments over the whole model."""
    num = torch.stack([(got[k] - w).norm() for k, w in want.items()]).norm()
    return (num / torch.stack([w.norm() for w in want.values()]).norm()).item()


def _train(base, group, variant, clip, **settings):
    model = copy.deepcopy(base)
    opt = sharded_adamw(model, group, model.blocks, bucket_numel=320, lr=1e-2, clip_grad=clip, **settings)
    for step in range(STEPS):
        opt.scale_loss(model(*_data(step, 0))).backward()
        opt.step(_lr(variant, step))
    opt.dp.wait_params()
    return model, opt


VARIANTS = {  # name: (stage, lr variant, settings)
    "fused": (1, "plain", {}),
    "unfused": (2, "plain", {"fused": False}),
    "schedule": (1, "schedule", {}),
    "offload": (1, "schedule", {"offload": True}),
    # the host multiplies the gradients by the unscale-and-clip factor itself (planted: it did not,
    # which only the binding clip's moments showed)
    "offload unfused": (1, "plain", {"offload": True, "fused": False}),
    "stage 3": (3, "plain", {}),
    "offload stage 3": (3, "plain", {"offload": True}),
    # fp16 gradient buffers (``precision.accumulate_fp32: false``): AdamW on the gradients rounded to
    # fp16 once and no further (planted: their fp32 copy beside the master rounded through bf16)
    "fp16 gradients": (2, "fp16grads", {"grad_dtype": torch.float16}),
}


def _skip_run(base, group, forced=False, **settings):
    """One step with an infinite loss, then a clean one: (skipped, scale after, parameters unchanged
    by the skipped step, the clean step's parameters equal a fresh optimizer's first step, the skipped
    step's norm). ``forced``: the loss and gradients are finite and the caller asks for the skip, as
    the engine does for a non-finite loss (``step(skip=...)``, a device flag)."""
    model, fresh = copy.deepcopy(base), copy.deepcopy(base)
    opt = sharded_adamw(model, group, model.blocks, stage=1, bucket_numel=320, lr=1e-2, **settings)
    other = sharded_adamw(fresh, group, fresh.blocks, stage=1, bucket_numel=320, lr=1e-2, **{
        k: v for k, v in settings.items() if k != "loss_scaler"})
    before = [p.detach().clone() for p in model.parameters()]
    opt.scale_loss(model(*_data(0, 0)) * (1.0 if forced else float("inf"))).backward()
    result = opt.step(skip=torch.tensor(forced))
    opt.dp.wait_params()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    scale = opt.scaler.scale
    for o, m in ((opt, model), (other, fresh)):  # the skipped step must not count for bias correction
        o.scale_loss(m(*_data(1, 0))).backward()
        o.step()
        o.dp.wait_params()
    clean = max((p - q).abs().max().item() for p, q in zip(model.parameters(), fresh.parameters()))
    return result.skipped, scale, unchanged, clean, result.grad_norm


def _skipped_stage3_release(base, group):
    """A stage-3 step of the pipeline's ``once_per_step`` mode (every block kept gathered through the
    backward) skipped for an fp16 overflow: which blocks hold gathered parameters before and after it."""
    model = copy.deepcopy(base)
    opt = sharded_adamw(model, group, model.blocks, stage=3, bucket_numel=320, lr=1e-2, once_per_step=True,
                        loss_scaler=DynamicLossScaler(initial_scale=1024, hysteresis=1))
    opt.scale_loss(model(*_data(0, 0)) * float("inf")).backward()
    before = tuple(holds_storage(block.fc.weight) for block in model.blocks)
    skipped = opt.step().skipped
    return before, skipped, tuple(holds_storage(block.fc.weight) for block in model.blocks)


def _resume_run(base, group, offload, stage=1):
    """Two steps, the state saved and loaded into a fresh optimizer, one more step on both: equal.
    Under stage 3 offloaded on the host, the load rounds into the kept 16-bit shard, not into the
    released unit buffers (which crashed the resume of such a CPU run). Also returns the saved scaler
    state as the load left it."""
    model = copy.deepcopy(base)
    opt = sharded_adamw(model, group, model.blocks, stage=stage, bucket_numel=320, lr=1e-2, offload=offload)
    for step in range(2):
        opt.scale_loss(model(*_data(step, 0))).backward()
        opt.step()
    state = {k: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v)) for k, v in opt.sharded_state_dict().items()}
    opt.dp.wait_params()
    copy_model = copy.deepcopy(base)
    resumed = sharded_adamw(copy_model, group, copy_model.blocks, stage=stage, bucket_numel=320, lr=1e-2,
                            offload=offload)
    resumed.load_sharded_state_dict(state)
    resumed.publish_loaded()
    for o, m in ((opt, model), (resumed, copy_model)):
        o.scale_loss(m(*_data(2, 0))).backward()
        o.step()
        o.dp.wait_params()
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), copy_model.parameters()))
    return state["adam_step"], diff, state["scaler"]


def _local_values(opt, state):
    """Each parameter's value of every state key, cut from a one-rank ``state``: what a resharding
    load hands ``load_local_state``."""
    values = [{key: torch.zeros(shape).reshape(-1) for key in STATE_KEYS} for _, shape, _ in opt.local_tensors()]
    for seg in opt.layout.segments:
        for key in STATE_KEYS:
            values[seg.param][key][seg.param_offset:seg.param_offset + seg.numel] = \
                state[key][seg.shard_offset:seg.shard_offset + seg.numel]
    return values


def _load_over_pending(base, group, local=False):
    """An offloaded optimizer whose last step is still pending (each unit is updated at its next use)
    loads a saved state: what comes after is the saved state, not the saved state updated again by
    the pending step. Returns how far the parameters then are from those saved. ``local``: loaded
    through each parameter's values (``load_local_state``, a resharded resume) instead of the shard."""
    model = copy.deepcopy(base)
    opt = sharded_adamw(model, group, model.blocks, stage=1, bucket_numel=320, lr=1e-2, offload=True)
    for step in range(2):
        opt.scale_loss(model(*_data(step, 0))).backward()
        opt.step()
    state = {k: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v)) for k, v in opt.sharded_state_dict().items()}
    opt.dp.wait_params()
    saved = [p.detach().clone() for p in model.parameters()]
    opt.scale_loss(model(*_data(2, 0))).backward()
    opt.step()
    if local:
        opt.load_local_state(_local_values(opt, state), state["adam_step"], state["scaler"])
    else:
        opt.load_sharded_state_dict(state)
    opt.publish_loaded()
    opt.dp.wait_params()
    return max((p - q).abs().max().item() for p, q in zip(model.parameters(), saved))


def _other_layouts_refused(base, group):
    """What loading a shard of another description reports: one saved with another bucket size
    (the same parameters and shard length, the segments elsewhere), and one of other parameter
    names. None where the load went through."""
    model, other = copy.deepcopy(base), copy.deepcopy(base)
    opt = sharded_adamw(model, group, model.blocks, stage=1, bucket_numel=320, lr=1e-2)
    moved = sharded_adamw(other, group, other.blocks, stage=1, bucket_numel=640, lr=1e-2).sharded_state_dict()
    assert moved["master"].numel() == opt.master.numel() and moved["params"] == opt.describe()["params"]
    renamed = {**opt.sharded_state_dict(), "params": [[f"other.{name}", *rest] for name, *rest in moved["params"]]}
    refusals = []
    for state in (moved, renamed):
        try:
            opt.load_sharded_state_dict(state)
            refusals.append(None)
        except ValueError as exc:
            refusals.append(str(exc))
    return refusals


def _guarded(fn, *args, **kwargs):
    """A case that raises fails its own test (with the traceback) rather than the whole world."""
    try:
        return fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - reported by the test that reads it
        return traceback.format_exc()


def _matches_reference(base, group, name, clip, refs):
    stage, variant, settings = VARIANTS[name]
    model, opt = _train(base, group, variant, clip, stage=stage, **settings)
    reference, _, ref_moments = refs[variant]
    err = max((p - q).abs().max().item() for p, q in zip(model.state_dict().values(), reference.state_dict().values()))
    return err, _relative(_first_moments(opt, group), ref_moments)


def _single_rank(rank, world_size):
    torch.manual_seed(0)
    base = Toy()
    group = dist.new_group([0])
    out = {}
    for clip in (1e9, 0.05):
        refs = {v: _reference(base, STEPS, 1, clip, v) for v in ("plain", "schedule", "fp16grads")}
        for name in VARIANTS:
            out[(name, clip)] = _guarded(_matches_reference, base, group, name, clip, refs)
    for fused in (True, False):
        out[("skip", fused)] = _guarded(_skip_run, base, group, fused=fused)
    out[("skip", "offload")] = _guarded(_skip_run, base, group, offload=True)
    out[("skip", "dynamic")] = _guarded(_skip_run, base, group,
                                        loss_scaler=DynamicLossScaler(initial_scale=1024, hysteresis=1))
    for fused in (True, False):
        out[("skip", "forced", fused)] = _guarded(_skip_run, base, group, forced=True, fused=fused)
    out["skipped stage 3"] = _guarded(_skipped_stage3_release, base, group)
    for offload in (False, True):
        for stage in (1, 3):
            out[("resume", offload, stage)] = _guarded(_resume_run, base, group, offload, stage)
    out["other layouts"] = _guarded(_other_layouts_refused, base, group)
    for local in (False, True):
        out[("load over pending", local)] = _guarded(_load_over_pending, base, group, local)
    return out


def _result(single_rank, key):
    value = single_rank[key]
    assert not isinstance(value, str), value  # the case raised: its traceback
    return value


@pytest.fixture(scope="module")
def single_rank():
    return run_world(1, _single_rank)[0]


@pytest.mark.parametrize("clip", [1e9, 0.05], ids=["loose clip", "binding clip"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_one_rank_matches_torch_adamw_with_its_moments(single_rank, name, clip):
    err, moment_err = _result(single_rank, (name, clip))
    tol, moment_tol = FP16_GRAD_TOLS if name == "fp16 gradients" else (TOL, MOMENT_TOL)
    assert err < tol, f"parameter error {err:.3g}"
    assert moment_err < moment_tol, moment_err


@pytest.mark.parametrize("kind", [True, False, "offload", "dynamic", ("forced", True), ("forced", False)],
                         ids=["fused", "unfused", "offload", "dynamic scaler", "forced fused", "forced unfused"])
def test_an_overflowing_step_is_skipped_and_not_counted(single_rank, kind):
    """A skip the caller forces with finite gradients (the engine's, for a non-finite loss) skips as an
    overflow does, and reports an infinite norm. (Planted: ``skip`` left out of the overflow flag, so
    the step trained on; the norm of a skipped step left finite.)"""
    key = ("skip", *kind) if isinstance(kind, tuple) else ("skip", kind)
    skipped, scale, unchanged, clean, norm = _result(single_rank, key)
    assert skipped and unchanged and norm == float("inf")
    assert scale == (512 if kind == "dynamic" else 1.0)  # hysteresis 1: the first overflow halves
    assert clean < TOL, f"the step after the skip differs from a first step by {clean:.3g}"


def test_a_skipped_stage3_step_releases_its_gathered_blocks(single_rank):
    """A step the fp16 loss scaler skips still ends as a taken one: stage 3 keeps only its shards, not
    every block it gathered for the backward. (Planted: the skipped step returning without ending the
    step, passed.)"""
    assert _result(single_rank, "skipped stage 3") == ((True,) * 3, True, (False,) * 3)


@pytest.mark.parametrize("stage", [1, 3], ids=["stage 1", "stage 3"])
@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_a_loaded_state_resumes_the_step_count(single_rank, offload, stage):
    """The load leaves the state it read as it was, so it can be loaded again (planted: the scaler's kind
    popped from the caller's dict, whose next load then took it for a converted model's, passed)."""
    adam_step, diff, scaler = _result(single_rank, ("resume", offload, stage))
    assert adam_step == 2
    assert diff == 0, f"resumed step differs by {diff:.3g}"
    assert scaler == {"kind": "ConstantLossScaler", "scale": 1.0}


@pytest.mark.parametrize("local", [False, True], ids=["same shard", "per parameter"])
def test_a_load_replaces_a_pending_offloaded_update(single_rank, local):
    """A state loaded while an offloaded step is still pending replaces that step, whether it is read
    as the same shard or per parameter (a resharded resume). (Planted: ``load_sharded_state_dict``,
    then ``load_local_state``, not applying the pending units first, whose late update then moved the
    loaded master on by one more step.)"""
    assert _result(single_rank, ("load over pending", local)) == 0


def test_a_shard_of_another_description_is_refused(single_rank):
    """A shard whose segments lie elsewhere (another bucket size: the same length, so a copy would go
    through and scramble every parameter) or whose parameters are others is refused, not copied.
    (Planted: only the shard's length compared, passed.)"""
    assert _result(single_rank, "other layouts") == ["the saved shard is laid out differently; load it through "
                                                     "its logical tensors"] * 2
