"""The 16-bit parameters under ZeRO: one flat buffer per unit, whole (stages 0-2) or sharded (3).

Each parameter's ``.data`` is a view into its unit's flat buffer, so updating the buffer updates
the model and a collective on a bucket moves many parameters at once. Under stage 3 a rank keeps
no 16-bit values between uses: a unit's full buffer is materialised just before the unit runs, by
rounding this rank's slices of the fp32 master into their places and all-gathering in place, and
its storage is released afterwards, while the parameter views stay attached to the (empty)
storage. Rounding at each gather instead of keeping a rounded copy of the shard saves 2 bytes per
shard element (as FSDP2 does, which casts its fp32 shard as it gathers) for a cast the size of the
shard per gather; the values are the same, since the master only changes in the optimizer step.
An offloaded master lives in host memory, so there the rounded shard (``shard``) is kept on the
device, where each step's uploads land. Autograd keeps references to the parameter views for
backward, so re-gathering into the same storage makes them valid again without touching the
autograd graph. While released, a parameter's class is ``ReleasedParameter``: its shape, dtype,
hooks and ``.grad`` stay readable, but reading its values (outside a forward, before
``DataParallel.wait_params()``) raises a clear error instead of reading storage that holds no
bytes, which crashed the process.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch.autograd import _unsafe_preserve_version_counter as keep_version  # gathers into saved storage
from torch.utils._pytree import tree_leaves

from parallel.data_parallel.host_copies import HostCopies, wait_on_current_stream
from parallel.data_parallel.layout import FlatLayout
from parallel.data_parallel.storage import release_storage, take_storage
from parallel import comm


def _metadata_reads() -> frozenset:
    """Tensor calls that read no element values: what code holding a released parameter may do."""
    getters = ("shape", "dtype", "device", "ndim", "layout", "requires_grad", "grad", "is_leaf", "grad_fn",
               "is_cuda", "is_meta", "is_sparse", "is_quantized")
    methods = ("dim", "size", "numel", "nelement", "element_size", "stride", "is_contiguous", "is_floating_point",
               "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "untyped_storage")
    return frozenset([getattr(torch.Tensor, g).__get__ for g in getters]
                     + [torch.Tensor.grad.__set__, torch.Tensor.requires_grad.__set__]
                     + [getattr(torch.Tensor, m) for m in methods])


_METADATA_READS = _metadata_reads()


class UnmaterializedParameterError(RuntimeError):
    """A released ZeRO-3 parameter's values were read."""


class ReleasedParameter(torch.nn.Parameter):
    """A stage-3 parameter whose unit is released: its storage holds no bytes, so any call that
    would read its values raises instead (see the module doc). The store switches a parameter's
    class to this on release and back on gather; the autograd graph never sees the difference."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func not in _METADATA_READS:
            released = next(t for t in tree_leaves((args, kwargs)) if isinstance(t, ReleasedParameter))
            raise UnmaterializedParameterError(
                f"ZeRO-3 parameter {getattr(released, 'zero3_name', '?')} {tuple(released.shape)} was read "
                f"outside a forward while only this rank's shard exists; call wait_params() on the "
                f"data-parallel wrapper (engine.data_parallel.wait_params()) first to gather every parameter")
        return super().__torch_function__(func, types, args, kwargs or {})


class ParamStore:
    def __init__(self, params: list[torch.nn.Parameter], layout: FlatLayout, dtype: torch.dtype, group,
                 sharded: bool, host_copies: Optional[HostCopies] = None, master: Optional[torch.Tensor] = None):
        """``master``: stage 3 on the device, the fp32 shard the optimizer updates in place (each
        ``load_owned`` hands it over again), which gathers round from; ``host_copies``: an
        offloaded master's uploads (see ``load_unit``)."""
        self.params, self.layout, self.dtype, self.group, self.sharded = params, layout, dtype, group, sharded
        if (master is not None) != (sharded and host_copies is None):
            raise ValueError("stage 3 with the master on the device gathers from it: pass master there only")
        self.host_copies = host_copies
        self.master = master
        # An offloaded unit's work on the copy stream (its upload; a one-rank gather's local copy) that
        # the compute stream must wait for before the unit runs; ``wait`` takes it.
        self._ready: dict[int, Optional[torch.cuda.Event]] = {}
        device = params[0].device
        self.units = [torch.zeros(n, dtype=dtype, device=device) for n in layout.unit_numel]
        for i, p in enumerate(params):
            flat = self._param_view(i)
            flat.copy_(p.detach().reshape(-1))
            p.data = flat.view(p.shape)
        self.shard = None
        self._host_buffer = None  # pinned 16-bit copy of an offloaded master, made at the first step
        self.gathered = [True] * len(self.units)
        self._pending: dict[int, list] = {}
        if sharded:
            if master is None:
                self.shard = torch.empty(layout.shard_numel, dtype=dtype, device=device)
                for bucket in layout.buckets:
                    self.shard_slice(bucket).copy_(self.owned_view(bucket))
            for unit in range(len(self.units)):
                self.release(unit)

    def _param_view(self, i: int) -> torch.Tensor:
        start = self.layout.param_offset[i]
        return self.units[self.layout.param_unit[i]][start:start + self.layout.param_numel[i]]

    def shard_slice(self, bucket) -> torch.Tensor:
        lo, hi = self.layout.shard_range(bucket)
        return self.shard[lo:hi]

    def owned_view(self, bucket) -> torch.Tensor:
        lo, hi = self.layout.owned_range(bucket)
        return self.units[bucket.unit][lo:hi]

    def owned_slice(self, bucket) -> Optional[torch.Tensor]:
        """Where this rank's updated 16-bit slice of ``bucket`` lives: the unit (stages 0-2), the shard
        (stage 3 offloaded); None where stage 3 rounds from the master as it gathers."""
        if not self.sharded:
            return self.owned_view(bucket)
        return None if self.shard is None else self.shard_slice(bucket)

    # --- stage 3: gather before use, release after -------------------------------------------
    def gather(self, unit: int, async_op: bool = False) -> None:
        """Start (or do) the all-gather of ``unit``; ``wait`` completes an asynchronous one."""
        if self.gathered[unit] or unit in self._pending:
            return
        take_storage(self.units[unit])
        self._pending[unit] = self._all_gather(unit, async_op)
        if not async_op:
            self.wait(unit)

    def _all_gather(self, unit: int, async_op: bool) -> list:
        """Rebuild ``unit``'s buffer in place from every rank's slices; the handles of async gathers.
        After an offloaded update they are issued on the copy stream behind the unit's upload."""
        buf = self.units[unit]
        with self._issue_stream(unit), keep_version(buf):
            handles = []
            for bucket in self.layout.unit_buckets(unit):
                owned = self.owned_slice(bucket)
                if owned is None:  # round the master into place; the gather then runs in place
                    lo, hi = self.layout.shard_range(bucket)
                    owned = self.owned_view(bucket)
                    owned.copy_(self.master[lo:hi])
                handles.append(comm.all_gather_into(buf[bucket.start:bucket.end], owned, self.group,
                                                    async_op=async_op))
            self._mark_ready(unit)
        return [h for h in handles if h is not None]

    def _issue_stream(self, unit: int):
        """Gathers of a freshly uploaded unit are issued on the copy stream, behind its upload, so the
        compute stream never waits for an upload it does not need yet. A stage-3 gather writes
        memory just allocated on the compute stream, so it also waits for the compute queued so far;
        a stage 1-2 unit's buffer is permanent and its last readers finished with the step."""
        if unit not in self._ready:
            return contextlib.nullcontext()
        return self.host_copies.on_stream(after_compute=self.sharded)

    def _mark_ready(self, unit: int) -> None:
        if unit in self._ready:
            self._ready[unit] = self.host_copies.record()

    def wait(self, unit: int) -> None:
        """Make ``unit``'s parameters current for the compute stream: its gathers, its upload."""
        wait_on_current_stream(self._ready.pop(unit, None))
        if unit not in self._pending:
            return
        for handle in self._pending.pop(unit):
            handle.wait()
        self.gathered[unit] = True
        self._set_class(unit, torch.nn.Parameter)

    def release(self, unit: int) -> None:
        if not self.sharded or not self.gathered[unit]:
            return
        release_storage(self.units[unit])
        self.gathered[unit] = False
        self._set_class(unit, ReleasedParameter)

    def _set_class(self, unit: int, cls: type) -> None:
        """Stage 3: a released unit's parameters refuse reads of their values (``ReleasedParameter``)."""
        if self.sharded:
            for i in self.layout.unit_params[unit]:
                self.params[i].__class__ = cls

    # --- after the optimizer step ------------------------------------------------------------
    def load_owned(self, master_shard: torch.Tensor, unit_order: list[int]) -> None:
        """Copy updated fp32 master values into this rank's 16-bit slices (an offloaded master: unit
        by unit in ``unit_order``, see ``load_unit``); stage 3 on the device only takes the master to
        round from at its next gathers."""
        if self.master is not None:
            self.master = master_shard
            return
        if master_shard.device != self.units[0].device:
            self.host_copies.synchronize()  # earlier uploads out of the pinned buffer are done
            for unit in unit_order:
                self.load_unit(master_shard, unit, after_compute=True)
            return
        # the unit (stages 0-2), or the kept 16-bit shard of an offloaded stage 3 on a CPU run (its
        # host master shares the units' device; the units themselves are released)
        for bucket in self.layout.buckets:
            lo, hi = self.layout.shard_range(bucket)
            self.owned_slice(bucket).copy_(master_shard[lo:hi], non_blocking=True)

    def load_unit(self, host_master: torch.Tensor, unit: int, after_compute: bool = False) -> None:
        """Offload: round ``unit``'s slices of the host master to 16 bits, into a reused pinned
        buffer (half the bytes, pinned-memory speed), and upload them on the copy stream; ``wait``
        (and a stage-3 gather) orders the unit's use after its own upload only. ``after_compute``:
        first let the compute stream finish what it queued (needless right after an offloaded step,
        which synchronised with the device). The caller makes sure the last upload out of the
        unit's pinned slices is done: an offloaded step synchronises the copy stream before any
        unit is loaded again."""
        if self._host_buffer is None:
            self._host_buffer = torch.empty(host_master.shape, dtype=self.dtype,
                                            pin_memory=self.units[0].device.type == "cuda")
        if unit in self._pending and not self.sharded:
            # A stage 1-2 gather issued at the unit's last update still reads the slices about to be
            # overwritten (no forward used the unit since): order the upload after it.
            with self.host_copies.on_stream(after_compute=False):
                self.wait(unit)
        for bucket in self.layout.unit_buckets(unit):
            lo, hi = self.layout.shard_range(bucket)
            host = self._host_buffer[lo:hi]
            host.copy_(host_master[lo:hi])
            self.host_copies.copy(self.owned_slice(bucket), host, after_compute=after_compute)
        self._ready[unit] = self.host_copies.record()

    def all_gather_buckets(self, unit_order: list[int]) -> None:
        """Stages 1-2: every rank updated its slice; each unit is rebuilt by in-place all-gathers.

        They are only started here, unit by unit in ``unit_order`` (the order the next forward uses
        them); ``wait(unit)``, called just before a unit runs, finishes them, so the gathers of later
        units overlap the computation of earlier ones."""
        for unit in unit_order:
            self.all_gather_unit(unit)

    def all_gather_unit(self, unit: int) -> None:
        """Start rebuilding ``unit`` from every rank's slices (stages 1-2); after an offloaded update,
        on the copy stream behind the unit's upload (see ``_issue_stream``)."""
        self._pending.setdefault(unit, []).extend(self._all_gather(unit, async_op=True))

    def wait_all(self) -> None:
        for unit in set(self._pending) | set(self._ready):
            self.wait(unit)

