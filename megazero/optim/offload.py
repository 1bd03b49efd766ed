"""ZeRO-Offload's update: AdamW on the host, unit by unit, each just before the unit is next used.

The fp32 master and Adam moments live in host memory. Each reduced gradient bucket is copied to
the host as soon as its last reduction completes, while backward still runs. The update itself
cannot start before backward ends (clipping needs the global norm), and on the host it is the
slowest part of the step, bound by memory bandwidth (about 28 bytes per parameter). So the step
only settles the coefficient and whether to skip; each unit's AdamW, its rounding to 16 bits and
its upload then run when the next forward first needs that unit (from the unit's pre-forward or
gather), and the GPU computes the units already updated while the host updates the next. It is
the wrapper's ``DeferredUpdate``: the wrapper applies pending units before their use, before it
hands over a new gradient bucket, and before anything reads the shard outside a forward.
"""

from __future__ import annotations

import torch

from parallel.data_parallel import DataParallel


class OffloadedUpdate:
    """Per-unit host AdamW steps for ``adam`` (whose parameters are views of ``master``, keyed by
    layout segment in ``master_views``) over the shard of ``dp``."""

    def __init__(self, adam: torch.optim.AdamW, master_views: dict, dp: DataParallel, master: torch.Tensor,
                 master_grad: torch.Tensor):
        self.dp, self.layout, self.copies = dp, dp.layout, dp.host_copies
        self.master, self.master_grad = master, master_grad
        self.fused = bool(adam.defaults.get("fused"))
        self.unit_adams = self._split_by_unit(adam, master_views)
        self.pending: list[int] = []  # units whose update is settled but not yet applied
        self.sent: set[int] = set()  # buckets whose gradients already left for the host this step

    def _split_by_unit(self, adam: torch.optim.AdamW, master_views: dict) -> dict[int, torch.optim.AdamW]:
        """One AdamW per unit over that unit's views, with the same state dicts as ``adam`` (which
        checkpoints keep reading) and its groups' hyperparameters as they are now: ``settle``
        forwards the learning rate each step; other hyperparameters are fixed for the run."""
        unit_of = {id(view): self.layout.param_unit[seg.param] for seg, view in master_views.items()}
        groups: dict[int, list[dict]] = {}
        for group in adam.param_groups:
            by_unit: dict[int, list[torch.Tensor]] = {}
            for view in group["params"]:
                if id(view) in unit_of:  # not the placeholder of an empty optimizer
                    by_unit.setdefault(unit_of[id(view)], []).append(view)
            for u, views in by_unit.items():
                groups.setdefault(u, []).append({**group, "params": views})
        out = {}
        for u, unit_groups in groups.items():
            out[u] = torch.optim.AdamW(unit_groups, fused=self.fused or None, foreach=adam.defaults.get("foreach"))
            for g in unit_groups:
                for view in g["params"]:
                    out[u].state[view] = adam.state[view]
        return out

    # --- gradients to the host ---------------------------------------------------------------
    def bucket_reduced(self, b: int) -> None:
        """Bucket ``b``'s reduced slice is final: start its copy to the host master's gradient (the
        wrapper applied the previous step's pending units, which read that buffer, first)."""
        lo, hi = self.layout.shard_range(self.layout.buckets[b])
        self.copies.copy(self.master_grad[lo:hi], self.dp.bucket_grad(b))
        self.sent.add(b)

    def clear(self) -> None:
        self.sent.clear()

    # --- the step ----------------------------------------------------------------------------
    def settle(self, coef: float, skip: bool, lr, unit_order: list[int]) -> None:
        """Bring every gradient to the host and fix this step's update; apply it lazily by unit.
        Nothing may be pending any more (the caller applied it)."""
        assert not self.pending, "settle() with units of the previous step still pending"
        for b in range(len(self.layout.buckets)):
            if b not in self.sent:
                self.bucket_reduced(b)
        self.clear()
        self.copies.synchronize()
        for adam in self.unit_adams.values():
            for group in adam.param_groups:
                group["lr"] = group["lr"] if lr is None else lr
        if skip:  # the master is unchanged, so are the 16-bit parameters on the GPU
            return
        scale = None
        if self.fused:  # the fused kernel divides each gradient by it as it reads it
            scale = torch.tensor(1.0 / coef, dtype=torch.float32)
        else:
            self.master_grad.mul_(coef)
        for adam in self.unit_adams.values():
            adam.grad_scale = scale
        self.pending = list(unit_order)

    def pending_units(self) -> list[int]:
        return self.pending

    def update_unit(self, unit: int) -> bool:
        """Apply the settled update to ``unit`` now and upload it, if it is still pending."""
        if unit not in self.pending:
            return False
        self.pending.remove(unit)
        if unit in self.unit_adams:
            self.unit_adams[unit].step()
        self.dp.load_unit(self.master, unit)
        return True
