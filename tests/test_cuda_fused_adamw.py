"""On a GPU the optimizer step never waits for the host: the one-pass AdamW kernel multiplies the
gradients by the unscale and clip coefficient and skips the update on the all-reduced overflow flag,
both kept on the device, and rounds the new master values into the 16-bit parameters itself (with
16-bit gradients, torch's fused AdamW does the update, taking the same two through ``grad_scale``
and ``found_inf``). These tests drive those paths on one CUDA device (a one-rank group), for every
ZeRO stage:

* with a clip that binds and one that does not, the parameters after 3 steps equal torch's plain
  single-process AdamW (on the CPU) within 2e-6, and the reported norm and the first moments the
  reference's within 1e-5;
* an inf injected into one gradient skips exactly that step without a dynamic loss scaler (the
  flag reaches the kernel as a device tensor), leaving the weights and Adam's step count as they
  were, and the next step trains; under fp16's dynamic scaler the same step is skipped too;
* the 16-bit parameters the kernel writes are exactly the master values rounded, and with 16-bit
  gradients torch's fused AdamW gives the same update as the kernel.

(Skipped without CUDA; on the CPU the same code runs the fused CPU AdamW where torch has one.)
"""

import copy

import pytest
import torch

from megazero.optim import DynamicLossScaler
from models import kernels
from tests.sharded import sharded_adamw
from tests.test_zero_toy import MICRO, NORM_TOL, STEPS, Toy, _data, _first_moments, _reference

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _optimizer(model, group, stage, clip=1e9, **kwargs):
    opt = sharded_adamw(model, group, model.blocks, stage=stage, bucket_numel=320, lr=1e-2, clip_grad=clip,
                        **kwargs)
    assert opt._fused, "the fused AdamW is not in use on this device"
    one_pass = kwargs.get("grad_dtype", torch.float32) == torch.float32 and kernels.use_fused(opt.master)
    assert (opt._tiles is not None) == one_pass, "the one-pass AdamW kernel is not in use on this device"
    return opt


def _needs_kernel():
    if not kernels.use_fused(torch.empty(0, device="cuda")):
        pytest.skip("the one-pass AdamW kernel is off (MEGAZERO_KERNELS=0 or no Triton)")


def _backward(model, opt, step):
    for micro in range(MICRO):
        opt.scale_loss(model(*(t.cuda() for t in _data(step, micro))) / MICRO).backward()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("clip", [1e9, 0.05])
def test_fused_step_equals_single_process_adamw(one_rank_group, stage, clip):
    torch.manual_seed(0)
    base = Toy()
    reference, ref_norms, ref_moments = _reference(base, STEPS, MICRO, clip)
    model = copy.deepcopy(base).cuda()
    opt = _optimizer(model, one_rank_group, stage, clip)
    norms = []
    for step in range(STEPS):
        _backward(model, opt, step)
        norms.append(opt.step().grad_norm)
    opt.dp.wait_params()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.detach().cpu() - q).abs().max().item() < 2e-6, name
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    moments = _first_moments(opt, one_rank_group)  # where Adam's normalised update hides a gradient factor
    for name, m in ref_moments.items():
        assert (moments[name] - m).norm() <= NORM_TOL * m.norm(), name


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_found_inf_skips_exactly_the_poisoned_step(one_rank_group, stage, dtype):
    torch.manual_seed(0)
    model = Toy().cuda()
    scaler = DynamicLossScaler(initial_scale=1024.0) if dtype == torch.float16 else None
    opt = _optimizer(model, one_rank_group, stage, param_dtype=dtype, loss_scaler=scaler)
    skipped, changed = [], []
    for step in range(3):
        opt.dp.wait_params()
        before = [p.detach().clone() for p in model.parameters()]
        hook = model.blocks[0].fc.weight.register_hook(lambda g: g * float("inf")) if step == 1 else None
        _backward(model, opt, step)
        if hook is not None:
            hook.remove()
        result = opt.step()
        skipped.append(result.skipped)
        opt.dp.wait_params()
        changed.append(any(not torch.equal(a, b) for a, b in zip(before, model.parameters())))
    assert skipped == [False, True, False]
    assert changed == [True, False, True]
    steps = {float(state["step"]) for state in opt.adam.state.values()}
    assert steps == {2.0}, "a skipped step advanced Adam's step count"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parameters_are_the_rounded_master(one_rank_group, stage):
    _needs_kernel()
    torch.manual_seed(0)
    model = Toy().cuda()
    opt = _optimizer(model, one_rank_group, stage, clip=0.05, param_dtype=torch.bfloat16)
    for step in range(STEPS):
        _backward(model, opt, step)
        opt.step()
    opt.dp.wait_params()
    for seg in opt.layout.segments:
        param = opt.dp.params[seg.param].detach().reshape(-1)[seg.param_offset:seg.param_offset + seg.numel]
        master = opt.master[seg.shard_offset:seg.shard_offset + seg.numel]
        assert torch.equal(param, master.to(torch.bfloat16)), opt.dp.info[seg.param].name


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_padding_stays_zero(one_rank_group, stage):
    """The kernel runs each parameter's last tile on into the layout's padding; stages 2-3 leave stale
    gradient sums there (their scratch buffers are reused, not cleared), which must not reach master,
    moments or parameters. Odd-sized parameters make padding after nearly every one."""
    _needs_kernel()
    torch.manual_seed(0)
    model = Toy().cuda()
    opt = _optimizer(model, one_rank_group, stage)
    for step in range(STEPS):
        _backward(model, opt, step)
        opt.step()
    padding = torch.ones_like(opt.master, dtype=torch.bool)
    for seg in opt.layout.segments:
        padding[seg.shard_offset:seg.shard_offset + seg.numel] = False
    assert padding.any(), "the toy model's layout has no padding to check"
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert not getattr(opt, key)[padding].any(), f"{key} padding is no longer zero"


@pytest.mark.parametrize("stage, betas", [(0, (0.9, 0.95)), (2, (0.9, 0.95)), (0, (0.0, 0.999))])
def test_one_pass_kernel_equals_torch_fused_adamw(one_rank_group, stage, betas):
    """Two copies of one model, updated by the kernel (fp32 gradients) and by torch's fused AdamW (bf16
    gradients copied into an fp32 buffer), from the same gradients, exact in bf16 and independent of
    the weights (a hook replaces each): equal within fp32 rounding, the clip binding at every step,
    also with a first moment of zero decay (beta1 = 0)."""
    _needs_kernel()
    torch.manual_seed(0)
    base = Toy().cuda()
    grads = [[torch.randn_like(p).bfloat16().float() for p in base.parameters()] for _ in range(STEPS)]
    runs = []
    for grad_dtype in (torch.float32, torch.bfloat16):
        model = copy.deepcopy(base)
        opt = _optimizer(model, one_rank_group, stage, clip=0.5, grad_dtype=grad_dtype, betas=betas)
        norms = []
        for step in range(STEPS):
            hooks = [p.register_hook(lambda g, new=new: new) for p, new in zip(model.parameters(), grads[step])]
            model(*(t.cuda() for t in _data(step, 0))).backward()
            for hook in hooks:
                hook.remove()
            norms.append(opt.step().grad_norm)
        opt.dp.wait_params()
        runs.append(([p.detach().clone() for p in model.parameters()], norms))
    (kernel, kernel_norms), (torch_fused, torch_norms) = runs
    assert kernel_norms == pytest.approx(torch_norms, rel=1e-6)
    assert min(kernel_norms) > 0.5, "the clip does not bind at every step"
    for a, b in zip(kernel, torch_fused):
        assert (a - b).abs().max().item() < 1e-6
