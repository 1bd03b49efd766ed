"""ZeRO: AdamW over fp32 master shards, with gradients and (stage 3) parameters sharded over dp.

One object drives a step for any stage:

=====  ==============================  =======================  ===========================
stage  16-bit parameters               gradients                fp32 master + Adam moments
=====  ==============================  =======================  ===========================
0      whole                           whole, all-reduced       whole
1      whole                           whole, reduce-scattered  owned shard
2      whole                           owned shard (buckets     owned shard
                                       reduced every backward)
3      owned shard, units gathered     owned shard              owned shard
       around their forward/backward
=====  ==============================  =======================  ===========================

With ``once_per_step`` (the pipeline-parallel mode) stages 2 and 3 keep whole gradients across
micro-batches and reduce them once at the step, and stage 3 keeps a unit gathered from its first
use to the step: a pipeline runs many micro-batches through each unit, and gathering or reducing
for each would multiply the communication by the micro-batch count.

The step is the math of single-process AdamW: gradients are summed over ranks and micro-batches,
divided by (dp x loss scale) and clipped by the global norm in a single multiply, then torch's
AdamW (fused on GPU, multi-threaded fused on CPU where torch has it) updates the master shard.
With the fused AdamW the step never waits for the host: the norm, the clip coefficient and the
overflow flag stay on the device and the fused kernel applies them itself (its ``grad_scale``
divides the gradients as it reads them, its ``found_inf`` skips the update), so the host keeps
queueing work while the GPU runs. Only a dynamic (fp16) loss scaler reads the flag each step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megazero.zero.grads import GradReducer
from megazero.zero.host_copies import HostCopies
from megazero.zero.layout import FlatLayout
from megazero.zero.loss_scaler import ConstantLossScaler
from megazero.zero.memory import zero_model_state_bytes
from megazero.zero.offload import OffloadedUpdate
from megazero.zero.params import ParamStore
from megazero.zero.stage3 import Stage3Hooks
from parallel import comm


@dataclass
class StepResult:
    """What a step did. The norm and the overflow flag stay device tensors until read, so that
    returning them costs no host sync."""
    norm: torch.Tensor  # of the unscaled, unclipped gradient; inf when the step overflowed
    overflow: torch.Tensor  # bool: the step was skipped on every rank
    loss_scale: float

    @property
    def grad_norm(self) -> float:
        return float(self.norm)

    @property
    def skipped(self) -> bool:
        return bool(self.overflow)


# 0: plain data parallelism; 1 shards the optimizer state, 2 also the gradients, 3 also the parameters
STAGES = (0, 1, 2, 3)


@dataclass
class ZeroSettings:
    stage: int = 1  # one of STAGES
    bucket_numel: int = 200 * 2**20 // 4  # elements; the config's default of 200 MiB of fp32 gradients
    param_dtype: torch.dtype = torch.float32
    grad_dtype: torch.dtype = torch.float32
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    overlap_comm: bool = True
    once_per_step: bool = False
    prefetch_depth: int = 1
    persistence_threshold: int = 0
    offload: bool = False
    fused: bool = True
    loss_scaler: object = None


class ZeroOptimizer:
    """AdamW under ZeRO ``settings.stage`` for ``model``'s parameters on this data-parallel rank.

    ``units`` are submodules whose parameters are grouped (and, under stage 3, gathered) together,
    in forward order; remaining parameters form one more unit kept gathered through a step.
    ``mp_group`` spans the tensor and pipeline ranks of one replica (the gradient norm is summed
    over it). ``counts_for_norm(name, param)`` says whether this rank's copy of a parameter enters the
    global gradient norm (False for copies replicated over tensor ranks other than the first,
    and for the second copy of a tied embedding), so nothing is counted twice. ``roots`` are the
    modules the caller invokes (pipeline chunks; default ``model``): under stage 3 their forward
    gathers the persistent unit. ``tied`` pairs a parameter with the group over which its gradient
    is summed before the data-parallel reduction (first and last pipeline stage's embedding).
    """

    def __init__(self, model: torch.nn.Module, settings: ZeroSettings, dp_group, mp_group,
                 units: Optional[list[torch.nn.Module]] = None,
                 counts_for_norm: Callable[[str, torch.nn.Parameter], bool] = lambda name, p: True,
                 roots: Optional[list[torch.nn.Module]] = None,
                 tied: Optional[list[tuple[torch.nn.Parameter, object]]] = None):
        self.s = settings
        self.dp_group, self.mp_group = dp_group, mp_group
        self.dp = dist.get_world_size(dp_group)
        self.dp_rank = dist.get_rank(dp_group)
        self.scaler = settings.loss_scaler or ConstantLossScaler()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        unit_params, unit_modules = _group_by_unit(named, units or [], settings.persistence_threshold)
        order = [i for members in unit_params for i in members]
        self.names = [named[i][0] for i in order]
        self.params = [named[i][1] for i in order]
        layout_dp = 1 if settings.stage == 0 else self.dp
        self.layout = FlatLayout([[named[i][1].numel() for i in members] for members in unit_params],
                                 settings.bucket_numel, layout_dp, 0 if settings.stage == 0 else self.dp_rank)
        self._build_master()
        self.host_copies = HostCopies(self.params[0].device) if settings.offload else None
        self.store = ParamStore(self.params, self.layout, settings.param_dtype, dp_group, sharded=settings.stage == 3,
                                host_copies=self.host_copies)
        sharded = settings.stage >= 2 and not settings.once_per_step
        self.reducer = GradReducer(self.params, self.layout, dp_group, settings.grad_dtype,
                                   mode="sharded" if sharded else "full", reduce_scatter=settings.stage > 0)
        self.stage3 = None
        # The order the forward uses units in: the persistent one (embeddings) first, then the blocks.
        self.unit_order = ([u for u, m in enumerate(unit_modules) if m is None]
                           + [u for u, m in reversed(list(enumerate(unit_modules))) if m is not None])
        if settings.stage == 3:
            self.stage3 = Stage3Hooks(roots or [model], unit_modules, self.store, settings.prefetch_depth,
                                      keep_until_step=settings.once_per_step)
        else:
            self._wait_before_use(roots or [model], unit_modules)
        index = {id(p): i for i, p in enumerate(self.params)}
        self.tied = [(index[id(p)], group) for p, group in (tied or [])]
        for i, _ in self.tied:
            self.reducer.defer(i)

        counted = [counts_for_norm(n, p) for n, p in zip(self.names, self.params)]
        # The reduced gradient of each owned segment: views into buffers that live as long as the optimizer.
        self._grads = [self.reducer.segment_grad(seg) for seg in self.layout.segments]
        self._norm_views = [g for seg, g in zip(self.layout.segments, self._grads) if counted[seg.param]]
        self._build_adam()
        self.offload = None
        if settings.offload:
            after_upload = self.store.all_gather_unit if settings.stage in (1, 2) else lambda unit: None
            self.offload = OffloadedUpdate(self.adam, self._master_views, self.layout, self.reducer, self.store,
                                           self.master, self.master_grad, self.host_copies, after_upload)
            self.reducer.on_final = self.offload.send
            if settings.stage == 3:  # stages 0-2 apply it from their pre-forward hooks
                self.store.before_use = self.offload.update

    # --- construction ------------------------------------------------------------------------
    def _build_master(self) -> None:
        """fp32 master copies of this rank's segments, taken before parameters become 16-bit."""
        device = torch.device("cpu") if self.s.offload else self.params[0].device
        self.master = torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=device)
        for seg in self.layout.segments:
            src = self.params[seg.param].detach().reshape(-1)[seg.param_offset:seg.param_offset + seg.numel]
            self.master[seg.shard_offset:seg.shard_offset + seg.numel].copy_(src)
        # AdamW needs fp32 gradients beside the fp32 master: a 16-bit gradient shard, or one that
        # lives on another device (offload), is copied into this buffer before each step.
        self.master_grad = None
        if self.s.offload or self.s.grad_dtype != torch.float32:
            self.master_grad = torch.zeros_like(self.master)
            if self.s.offload and torch.cuda.is_available():
                self.master_grad = self.master_grad.pin_memory()

    def _build_adam(self) -> None:
        decay, no_decay = [], []
        self._master_views = {}
        for seg, grad in zip(self.layout.segments, self._grads):
            view = self.master[seg.shard_offset:seg.shard_offset + seg.numel]
            self._master_views[seg] = view
            view.grad = (self.master_grad[seg.shard_offset:seg.shard_offset + seg.numel]
                         if self.master_grad is not None else grad)
            (decay if self.params[seg.param].dim() >= 2 else no_decay).append(view)
        groups = [{"params": decay, "weight_decay": self.s.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]] or [{"params": [torch.zeros(0, requires_grad=False)]}]
        kwargs = _fast_adam_kwargs(self.master.device, self.s.fused)
        self._fused = kwargs.get("fused", False)
        self.adam = torch.optim.AdamW(groups, lr=self.s.lr, betas=self.s.betas, eps=self.s.eps, **kwargs)
        self._init_adam_state(fused=self._fused)

    def _init_adam_state(self, fused: bool) -> None:
        """Allocate the moments now, as two flat shard-sized buffers the per-segment states view:
        contiguous like the master (no fragmentation), measured by the start-up memory report, and
        an out-of-memory shows before any work is done. The keys and the step tensor's dtype and
        device are what torch's AdamW would create itself."""
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        step_device = self.master.device if fused else torch.device("cpu")
        for seg in self.layout.segments:
            view = self._master_views[seg]
            lo, hi = seg.shard_offset, seg.shard_offset + seg.numel
            self.adam.state[view] = {"step": torch.zeros((), dtype=torch.float32, device=step_device),
                                     "exp_avg": self.exp_avg[lo:hi], "exp_avg_sq": self.exp_avg_sq[lo:hi]}

    def _wait_before_use(self, roots, unit_modules) -> None:
        """Stages 1-2 leave the post-step all-gathers running, and an offloaded step leaves each
        unit's update to its next use: a unit applies and waits for its own just before its forward
        (the roots for the persistent unit), so they overlap the next step's compute."""
        persistent = [u for u, m in enumerate(unit_modules) if m is None]

        def before_use(unit: int) -> None:
            if self.offload is not None:
                self.offload.update(unit)
            self.store.wait(unit)

        def before_persistent(module, args):
            for u in persistent:
                before_use(u)
        for root in roots:
            root.register_forward_pre_hook(before_persistent)
        for u, module in enumerate(unit_modules):
            if module is not None:
                module.register_forward_pre_hook(lambda module, args, u=u: before_use(u))

    def apply_pending(self) -> None:
        """Apply an offloaded step's update to the units no forward has used yet: before reading the
        master, the moments or the parameters outside a forward (checkpoints do)."""
        if self.offload is not None:
            self.offload.finish()

    def wait_params(self) -> None:
        """Make every 16-bit parameter current, for code that reads them outside a forward."""
        self.apply_pending()
        self.store.wait_all()
        if self.stage3 is not None:
            for unit in range(len(self.store.units)):
                self.store.gather(unit)

    # --- the training loop's calls -----------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale

    def begin_microbatch(self, last: bool) -> None:
        """Optional: ``last=True`` before the final backward lets stages 0/1 overlap their reduction."""
        self.reducer.begin_microbatch(last and self.s.overlap_comm)

    def zero_grad(self) -> None:
        self.reducer.zero()
        if self.offload is not None:
            self.offload.clear()

    def step(self, lr: Optional[float] = None, skip: bool | torch.Tensor = False) -> StepResult:
        """Reduce, unscale, clip and update; skipped on every rank together if any overflowed.

        ``skip`` (which must agree on every rank, e.g. a non-finite loss, as a bool or a device
        flag) forces the skip."""
        for i, group in self.tied:
            comm.all_reduce(self.reducer.accumulated_grad(i), group)
        self.reducer.finish()
        scale = self.scaler.scale
        unscale = 1.0 / (self.dp * scale)
        grad_norm = self._global_norm_sq().sqrt() * unscale
        overflow = ~torch.isfinite(grad_norm) | skip  # a bool needs no copy to the device
        grad_norm = grad_norm.masked_fill(overflow, math.inf)
        coef = torch.full_like(grad_norm, unscale)
        if self.s.clip_grad > 0:
            coef = coef * (self.s.clip_grad / (grad_norm + 1e-6)).clamp(max=1.0)
        known_skip = False  # only a dynamic scaler reads the flag on the host
        if self.scaler.dynamic:
            known_skip = bool(overflow)
            self.scaler.update(known_skip)
        if lr is not None:
            for group in self.adam.param_groups:
                group["lr"] = lr
        if self.offload is not None:  # the host waits for the gradients anyway
            self.offload.settle(float(coef), bool(overflow), lr, self.unit_order)
        elif not known_skip:  # a skipped step leaves the parameters as they are: nothing to rebuild
            self._update(coef, overflow)
            self._rebuild_params()
        self.zero_grad()
        self._after_step()
        return StepResult(grad_norm, overflow, scale)

    def _update(self, coef: torch.Tensor, overflow: torch.Tensor) -> None:
        """AdamW on the (device) master shard with gradients times ``coef``, unless ``overflow``."""
        self._copy_grads_to_master()
        if self._fused:
            # Passed as the fused kernel's own unscale/skip inputs: no pass over the gradients
            # and no host sync.
            self.adam.grad_scale = coef.reciprocal().float()
            self.adam.found_inf = overflow.float()
        elif bool(overflow):
            return
        elif self.master_grad is not None:
            self.master_grad.mul_(float(coef))
        elif self._grads:
            torch._foreach_mul_(self._grads, float(coef))
        self.adam.step()

    def _after_step(self) -> None:
        if self.stage3 is not None:
            self.stage3.release_all()

    def _global_norm_sq(self) -> torch.Tensor:
        """Sum of squares over the whole model: this rank's counted segments, summed over the
        model-parallel group and (when gradients are sharded) the data-parallel group. NaN or inf
        anywhere makes the sum non-finite on every rank, which is the overflow signal."""
        views = self._norm_views
        device = views[0].device if views else self.params[0].device
        # fp32 per-segment norms: a 16-bit norm of loss-scaled gradients overflows long before they do
        local = (torch.stack(torch._foreach_norm(views, 2, dtype=torch.float32)).double().pow(2).sum() if views
                 else torch.zeros((), dtype=torch.float64, device=device))
        if self.mp_group is not None:
            comm.all_reduce(local, self.mp_group)
        if self.s.stage > 0:
            comm.all_reduce(local, self.dp_group)
        return local

    def _copy_grads_to_master(self) -> None:
        """Copy 16-bit reduced gradients into the fp32 buffer beside the master, bucket by bucket (the
        master's layout is the shard's, so each bucket's slice is one contiguous copy)."""
        if self.master_grad is None:
            return
        for b, bucket in enumerate(self.layout.buckets):
            lo, hi = self.layout.shard_range(bucket)
            self.master_grad[lo:hi].copy_(self.reducer.bucket_grad(b))

    # --- inspection --------------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """Bytes of storage this rank really holds per model-state category, read from the tensors'
        storages (so views are counted once and a released stage-3 unit counts zero)."""
        moments = [t for st in self.adam.state.values() for k, t in st.items() if k in ("exp_avg", "exp_avg_sq")]
        grads = [self.reducer.flat, self.reducer.shard, self.master_grad, *self.reducer.pool, *self._grads]
        return {"params": _storage_bytes(self.params + [self.store.shard]),
                "grads": _storage_bytes(grads),
                "master": _storage_bytes(list(self._master_views.values()) + [self.master]),
                "optimizer": _storage_bytes(moments)}

    def predicted_memory(self):
        """What the ZeRO formula says this rank should hold, for the padded element count, plus
        the fp32 gradient copy of the shard when gradients are kept in 16 bits or offloaded."""
        formula = zero_model_state_bytes(
            self.layout.numel, self.dp, self.s.stage,
            param_bytes=_itemsize(self.s.param_dtype), grad_bytes=_itemsize(self.s.grad_dtype),
            full_grads=self.s.once_per_step)
        if self.master_grad is None:
            return formula
        return dataclasses.replace(formula, grads=formula.grads + formula.master)

    def reload_params(self) -> None:
        """After the master shard was overwritten (a checkpoint load): rebuild the 16-bit weights."""
        self._rebuild_params()
        self._after_step()

    def _rebuild_params(self) -> None:
        """16-bit parameters from the master: this rank's slices, then (stages 1-2) every rank's."""
        self.store.load_owned(self.master, self.unit_order)
        if self.s.stage in (1, 2):
            self.store.all_gather_buckets(self.unit_order)


def _group_by_unit(named, units, persistence_threshold: int):
    """Indices of ``named`` per unit, in forward order, plus the leftover (persistent) unit last."""
    index = {id(p): i for i, (_, p) in enumerate(named)}
    taken: set[int] = set()
    groups, modules = [], []
    for module in units:
        members = [index[id(p)] for p in module.parameters()
                   if id(p) in index and index[id(p)] not in taken and p.numel() >= persistence_threshold]
        if members:
            taken.update(members)
            groups.append(members)
            modules.append(module)
    rest = [i for i in range(len(named)) if i not in taken]
    if rest:
        groups.append(rest)
        modules.append(None)
    # Buckets fill in backward order, so lay units and their parameters out last-first.
    return [list(reversed(g)) for g in reversed(groups)], list(reversed(modules))


def _storage_bytes(tensors) -> int:
    storages = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            storages[storage.data_ptr(), storage.nbytes()] = storage.nbytes()
    return sum(storages.values())


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _fast_adam_kwargs(device: torch.device, fused: bool) -> dict:
    if fused and device.type == "cuda":
        return {"fused": True}
    if fused and device.type == "cpu" and _cpu_fused_supported():
        return {"fused": True}
    return {"foreach": device.type == "cuda"}


def _cpu_fused_supported() -> bool:
    try:
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)], fused=True)
        return True
    except (RuntimeError, ValueError):
        return False
