"""AdamW over the fp32 shard a ``DataParallel`` wrapper describes: master, moments, step, loss scale.

The step is the math of single-process AdamW: gradients are summed over ranks and micro-batches by
the wrapper (fp16 buffers hold the ranks' mean: ``grads_summed_over``), divided by (dp x loss scale)
and clipped by the global norm in a single multiply here,
then AdamW updates the master shard and the 16-bit parameters are rounded from it. On a GPU with
Triton, one kernel per bucket does both in a single pass over the shard (``models.kernels.adamw``);
otherwise torch's AdamW (fused on GPU, multi-threaded fused on CPU where torch has it) updates the
master and the wrapper rounds it back. On a GPU the step never waits for the host: the norm, the
clip coefficient and the overflow flag stay on the device and the kernel applies them itself (as
torch's fused AdamW takes them through ``grad_scale`` and ``found_inf``), so the host keeps queueing
work while the GPU runs. Only a dynamic (fp16) loss scaler reads the flag each step. With offload
the master and moments live in host memory and each unit's update is applied when the unit is next
used (``offload``).

Its state is explicit: ``sharded_state_dict()`` is the shard with the description that places every
element, (logical parameter name, tensor-parallel slice, offset), and is all a checkpoint reads.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from megazero.optim.loss_scaler import ConstantLossScaler, scaler_change
from megazero.optim.memory import zero_model_state_bytes
from megazero.optim.offload import OffloadedUpdate
from models import kernels
from parallel import comm
from parallel.data_parallel import DataParallel, storage_bytes

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


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


@dataclass
class AdamWSettings:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    fused: bool = True


class ShardedAdamW:
    """AdamW for the shard of ``dp``. ``mp_group`` spans the tensor and pipeline ranks of one replica
    (the gradient norm is summed over it); ``loss_scaler`` defaults to a constant scale of 1."""

    def __init__(self, dp: DataParallel, settings: AdamWSettings, mp_group=None, loss_scaler=None):
        self.dp, self.s, self.mp_group = dp, settings, mp_group
        self.layout = dp.layout
        self.scaler = loss_scaler or ConstantLossScaler()
        self.scaler_note: Optional[str] = None  # what the last load did not carry over, for rank 0 to say
        offload = dp.settings.offload
        self.master = dp.take_initial_shard()  # in host memory when offloaded
        # AdamW needs fp32 gradients beside the fp32 master: a 16-bit gradient shard, or one that
        # lives on another device (offload), is copied into this buffer before each step.
        self.master_grad = None
        if offload or dp.settings.grad_dtype != torch.float32:
            self.master_grad = torch.zeros_like(self.master)
            if offload and torch.cuda.is_available():
                self.master_grad = self.master_grad.pin_memory()
        # The reduced gradient of each owned segment: views into buffers that live as long as the wrapper.
        self._grads = [dp.segment_grad(seg) for seg in self.layout.segments]
        self._norm_views = [g for seg, g in zip(self.layout.segments, self._grads)
                            if dp.info[seg.param].counts_for_norm]
        self._copy_views = [g for seg, g in zip(self.layout.segments, self._grads)
                            if not dp.info[seg.param].counts_for_norm]
        self._tiles = self._bucket_tiles() if self._one_pass() else None
        self._build_adam()
        if self._tiles is not None:  # the kernel's bias corrections are computed from them on the device
            self._betas = torch.tensor(self.s.betas, dtype=torch.float64, device=self.master.device)
        self.offload = None
        if offload:
            self.offload = OffloadedUpdate(self.adam, self._master_views, dp, self.master, self.master_grad)
            dp.attach(self.offload)

    # --- construction ------------------------------------------------------------------------
    def _build_adam(self) -> None:
        decay, no_decay = [], []
        self._master_views = {}
        for seg, grad in zip(self.layout.segments, self._grads):
            view = self.master[seg.shard_offset:seg.shard_offset + seg.numel]
            self._master_views[seg] = view
            view.grad = (self.master_grad[seg.shard_offset:seg.shard_offset + seg.numel]
                         if self.master_grad is not None else grad)
            (decay if self.dp.params[seg.param].dim() >= 2 else no_decay).append(view)
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
        device are what torch's AdamW would create itself. The one-pass update counts steps in one
        tensor, which every state shares (torch's AdamW, which would count it once per segment,
        never runs then)."""
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        step_device = self.master.device if fused else torch.device("cpu")
        self._step = torch.zeros((), dtype=torch.float32, device=step_device) if self._tiles is not None else None
        for seg in self.layout.segments:
            view = self._master_views[seg]
            lo, hi = seg.shard_offset, seg.shard_offset + seg.numel
            step = self._step if self._step is not None else torch.zeros((), dtype=torch.float32, device=step_device)
            self.adam.state[view] = {"step": step, "exp_avg": self.exp_avg[lo:hi], "exp_avg_sq": self.exp_avg_sq[lo:hi]}

    def _one_pass(self) -> bool:
        """Whether the Triton kernel updates master and parameters together: on a GPU where the kernels
        are on (Triton importable, ``MEGAZERO_KERNELS`` not 0), with the fused AdamW asked for, no
        offload, and fp32 gradients (16-bit ones are first copied into ``master_grad``, a pass of its
        own, and torch's fused AdamW runs)."""
        return (self.s.fused and self.master_grad is None and not self.dp.settings.offload
                and kernels.use_fused(self.master))

    def _bucket_tiles(self) -> list[torch.Tensor]:
        """Per bucket, the kernel's table of tiles over the bucket's segments (built once: the layout
        is fixed)."""
        from models.kernels.adamw import tile_table

        tiles = []
        for bucket in self.layout.buckets:
            lo, hi = self.layout.shard_range(bucket)
            segments = [(seg.shard_offset - lo, seg.numel, self.dp.params[seg.param].dim() >= 2)
                        for seg in self.layout.segments if lo <= seg.shard_offset < hi]
            tiles.append(tile_table(segments, hi - lo, self.master.device))
        return tiles

    # --- the training loop's calls -----------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale

    def zero_grad(self) -> None:
        self.dp.zero_grad()
        if self.offload is not None:
            self.offload.clear()

    def step(self, lr: Optional[float] = None, skip: bool | torch.Tensor = False) -> StepResult:
        """Reduce, unscale, clip and update; skipped on every rank together if any overflowed.

        ``skip`` (which must agree on every rank, e.g. a non-finite loss, as a bool or a device
        flag) forces the skip."""
        self.dp.finish_reduction()
        scale = self.scaler.scale
        unscale = 1.0 / (self.dp.grads_summed_over * scale)
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
            self.dp.apply_deferred()  # the previous step's last units, before their gradients go
            self.offload.settle(float(coef), bool(overflow), lr, self.dp.unit_order)
            self.dp.end_step()
        elif known_skip:  # a skipped step leaves the parameters as they are: nothing to rebuild
            self.dp.end_step()
        elif self._tiles is not None:
            self._update_in_one_pass(coef.float(), overflow)
            self.dp.publish_owned()
        else:
            self._update(coef, overflow)
            self.dp.load_shard(self.master)
        self.zero_grad()
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

    def _update_in_one_pass(self, coef: torch.Tensor, overflow: torch.Tensor) -> None:
        """AdamW on the master shard with gradients times ``coef``, unless ``overflow``, rounding each
        bucket's new values into its 16-bit parameters in the same kernel."""
        from models.kernels.adamw import adamw_bucket

        self._step.add_(overflow.logical_not())
        corrections = (1 - self._betas**self._step).float()  # 1 - beta^t, in fp64 (a beta of 0 included)
        lr = self.adam.param_groups[0]["lr"]  # step() sets every group's
        self.dp.before_owned_write()
        for b, bucket in enumerate(self.layout.buckets):
            lo, hi = self.layout.shard_range(bucket)
            adamw_bucket(self._tiles[b], self.dp.bucket_grad(b), self.master[lo:hi], self.exp_avg[lo:hi],
                         self.exp_avg_sq[lo:hi], self.dp.owned_params(b), coef, overflow, corrections,
                         lr=lr, weight_decay=self.s.weight_decay, betas=self.s.betas, eps=self.s.eps)

    def _global_norm_sq(self) -> torch.Tensor:
        """Sum of squares over the whole model: this rank's counted segments, summed over the
        model-parallel group and (when gradients are sharded) the data-parallel group. NaN or inf
        anywhere makes the sum non-finite on every rank, which is the overflow signal: in a copy too
        (a tensor-parallel replica off the first tensor rank, a tied head), which the norm leaves out
        as its first holder counts it. Copies are equal but for a fault, and a fault there went
        unseen: that copy turned NaN and every later step was skipped."""
        device = self.dp.params[0].device
        local = _sum_of_squares(self._norm_views, device)
        if self._copy_views:  # 0 times a finite sum is 0; times inf or NaN, NaN
            local = local + 0.0 * _sum_of_squares(self._copy_views, device)
        if self.mp_group is not None:
            comm.all_reduce(local, self.mp_group)
        if self.dp.settings.stage > 0:
            comm.all_reduce(local, self.dp.dp_group)
        return local

    def _copy_grads_to_master(self) -> None:
        """Copy 16-bit reduced gradients into the fp32 buffer beside the master, bucket by bucket (the
        master's layout is the shard's, so each bucket's slice is one contiguous copy)."""
        if self.master_grad is None:
            return
        for b, bucket in enumerate(self.layout.buckets):
            lo, hi = self.layout.shard_range(bucket)
            self.master_grad[lo:hi].copy_(self.dp.bucket_grad(b))

    # --- explicit state ----------------------------------------------------------------------
    def describe(self) -> dict:
        """What each element of the shard is: per parameter (logical name, local shape, tensor-
        parallel slice [dim, index, count] or None), and the segments placing them in the shard
        (parameter, offset in it, offset in the shard, length). Two shards with equal descriptions
        are interchangeable element for element. Lists, not tuples, so a description read back from
        a file compares equal to a fresh one."""
        return shard_description(self.local_tensors(), [(s.param, s.param_offset, s.shard_offset, s.numel)
                                                        for s in self.layout.segments])

    def sharded_state_dict(self) -> dict:
        """The shard of master and moments with its description, the Adam step and the loss scaler."""
        self.dp.apply_deferred()
        step = next(iter(self.adam.state.values()))["step"] if self.adam.state else torch.zeros(())
        return {**self.describe(), **{key: getattr(self, key) for key in STATE_KEYS},
                "adam_step": float(step), "scaler": {"kind": type(self.scaler).__name__, **self.scaler.state_dict()}}

    def load_sharded_state_dict(self, state: dict) -> None:
        """Load a shard saved by an optimizer with the same description (an exact resume); the
        parameters take it at ``publish_loaded``."""
        mine = self.describe()
        if (state["params"] != mine["params"] or not torch.equal(state["segments"], mine["segments"])
                or state["master"].numel() != self.master.numel()):
            raise ValueError("the saved shard is laid out differently; load it through its logical tensors")
        self.dp.apply_deferred()  # an update applied after the load would overwrite it
        for key in STATE_KEYS:
            getattr(self, key).copy_(state[key])
        self._finish_load(state["adam_step"], state["scaler"])

    def local_tensors(self) -> list[tuple[str, tuple, object]]:
        """For each parameter: (logical name, local shape, tensor-parallel slice or None), what
        ``load_local_state`` expects values for."""
        return [(info.name, tuple(p.shape), info.shard) for info, p in zip(self.dp.info, self.dp.params)]

    def load_local_state(self, values: Iterable[dict[str, torch.Tensor]], adam_step: float, scaler: dict) -> None:
        """Load from each parameter's local (this rank's tensor-parallel slice) value of every state
        key, in ``local_tensors`` order: the path of a checkpoint saved in another layout. ``values``
        is consumed one parameter at a time, so a caller can build each just before it is used. The
        parameters take it at ``publish_loaded``."""
        self.dp.apply_deferred()
        by_param: dict[int, list] = {}
        for seg in self.layout.segments:
            by_param.setdefault(seg.param, []).append(seg)
        for i, value in enumerate(values):
            for seg in by_param.get(i, ()):
                for key in STATE_KEYS:
                    getattr(self, key)[seg.shard_offset:seg.shard_offset + seg.numel] = \
                        value[key].reshape(-1)[seg.param_offset:seg.param_offset + seg.numel]
        self._finish_load(adam_step, scaler)

    def _finish_load(self, adam_step: float, scaler: dict) -> None:
        for state in self.adam.state.values():
            state["step"].fill_(adam_step)
        scaler = dict(scaler)
        kind = scaler.pop("kind", None)
        self.scaler_note = scaler_change(kind, self.scaler)  # another precision: the saved scale means nothing here
        if kind == type(self.scaler).__name__:
            self.scaler.load_state_dict(scaler)

    def publish_loaded(self) -> None:
        """Round the loaded shard into the 16-bit parameters and start their all-gather: the load's one
        collective, which every rank of the data-parallel group must reach. Apart from the loads, so
        that a caller whose reads may fail on some ranks reaches it only once they agree all succeeded
        (``checkpoint.state.load_checkpoint``)."""
        self.dp.load_shard(self.master)

    # --- inspection --------------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """Bytes of storage this rank really holds per model-state category, read from the tensors'
        storages (so views are counted once and a released stage-3 unit counts zero)."""
        held = self.dp.memory_bytes()
        moments = [t for st in self.adam.state.values() for k, t in st.items() if k in ("exp_avg", "exp_avg_sq")]
        return {"params": held["params"],
                "grads": held["grads"] + storage_bytes([self.master_grad]),
                "master": storage_bytes(list(self._master_views.values()) + [self.master]),
                "optimizer": storage_bytes(moments)}

    def predicted_memory(self):
        """What the ZeRO formula says this rank should hold, for the padded element count, plus
        the fp32 gradient copy of the shard when gradients are kept in 16 bits or offloaded."""
        d = self.dp.settings
        formula = zero_model_state_bytes(
            self.layout.numel, self.dp.dp, d.stage,
            param_bytes=_itemsize(d.param_dtype), grad_bytes=_itemsize(d.grad_dtype),
            full_grads=d.once_per_step, param_shard=d.offload)
        if self.master_grad is None:
            return formula
        return dataclasses.replace(formula, grads=formula.grads + formula.master)


def shard_description(params, segments) -> dict:
    """The description ``ShardedAdamW.describe`` gives, from ``params`` ((logical name, local shape,
    tp ``Shard`` or None) each) and ``segments`` ((param, param offset, shard offset, count) each):
    also what an offline writer records for a rank that has not run."""
    return {"params": [[name, list(shape), None if s is None else [s.dim, s.index, s.count]]
                       for name, shape, s in params],
            "segments": torch.tensor(list(segments), dtype=torch.int64).reshape(-1, 4)}


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


def _sum_of_squares(views: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The fp64 sum of the squared fp32 norms of ``views`` (a 16-bit norm of loss-scaled gradients
    overflows long before they do); 0 for none."""
    if not views:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(torch._foreach_norm(views, 2, dtype=torch.float32)).double().pow(2).sum()
