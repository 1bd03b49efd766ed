"""ZeRO stage 3: gather a unit's parameters just before it runs, release them right after.

``fetch(unit, async_op)`` is the wrapper's way of gathering a unit: it first applies a deferred
(offloaded) update to the unit's slices, then starts the all-gather.

Module hooks drive it, so the model code stays unaware:

* forward pre-hook: wait for (or do) the unit's all-gather, then start gathering the next
  ``prefetch_depth`` units asynchronously so their communication hides behind this compute;
* forward hook: release the unit and hook its outputs, whose gradient arriving means the unit's
  backward is about to run;
* that output hook: gather the unit again and prefetch the units before it;
* parameter post-accumulate hooks: once every parameter of the unit has its gradient, release it.

Parameters outside any unit (embeddings, final norm, head; and with a persistence threshold the
small ones) are gathered when a root module (the model, or each pipeline chunk) starts its forward,
and kept until the step. Recomputation under activation checkpointing runs forward hooks during
backward; they neither release nor re-hook then, because the unit is in use by its own backward.
"""

from __future__ import annotations

from typing import Callable

import torch

from parallel.data_parallel.hooks import add_grad_hook
from parallel.data_parallel.params import ParamStore


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Stage3Hooks:
    def __init__(self, roots: list[torch.nn.Module], unit_modules: list, store: ParamStore,
                 fetch: Callable[[int, bool], None], prefetch_depth: int, keep_until_step: bool, names: dict):
        self.store, self.fetch, self.prefetch_depth, self.keep = store, fetch, prefetch_depth, keep_until_step
        self.persistent = [u for u, m in enumerate(unit_modules) if m is None]
        self.forward_order = [u for u, m in reversed(list(enumerate(unit_modules))) if m is not None]
        self.position = {u: k for k, u in enumerate(self.forward_order)}
        layout = store.layout
        self.pending = {u: len(layout.unit_params[u]) for u in range(len(unit_modules))}
        self.received = dict.fromkeys(self.pending, 0)
        self._callback_queued = False
        self._handles = [root.register_forward_pre_hook(self._model_pre) for root in roots]
        for p in store.params:  # for the error a read of a released parameter raises
            p.zero3_name = names.get(id(p), "?")
        for u, module in enumerate(unit_modules):
            if module is None:
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre_forward(u)))
            self._handles.append(module.register_forward_hook(self._post_forward(u)))
            for i in layout.unit_params[u]:
                self._handles.append(add_grad_hook(store.params[i], self, type(self)._grad_arrived, u))

    def _model_pre(self, module, args) -> None:
        for u in self.persistent:
            self.fetch(u, False)

    def _prefetch(self, unit: int, direction: int) -> None:
        """Fetch up to ``prefetch_depth`` units after ``unit`` in ``direction``: those the model has (a
        depth of 10**18 walked 10**18 steps past them, the first step never ending)."""
        k = self.position[unit]
        for step in range(1, min(self.prefetch_depth, len(self.forward_order)) + 1):
            j = k + direction * step
            if 0 <= j < len(self.forward_order):
                self.fetch(self.forward_order[j], True)

    def _pre_forward(self, unit: int):
        def hook(module, args):
            self.fetch(unit, False)
            self.store.wait(unit)
            if not _in_backward():
                self._prefetch(unit, +1)
        return hook

    def _post_forward(self, unit: int):
        def hook(module, args, output):
            if _in_backward() or not torch.is_grad_enabled():
                if not torch.is_grad_enabled() and not self.keep:
                    self.store.release(unit)
                return output
            if not self.keep:
                self.store.release(unit)
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._pre_backward(unit))
                    break
            return output
        return hook

    def _pre_backward(self, unit: int):
        def hook(grad):
            self.fetch(unit, False)
            self.store.wait(unit)
            self._prefetch(unit, -1)
            return grad
        return hook

    def _grad_arrived(self, unit: int, param: torch.Tensor) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        self.received[unit] += 1
        if self.received[unit] == self.pending[unit]:
            self.received[unit] = 0
            if not self.keep:
                self.store.release(unit)

    def _end_of_backward(self) -> None:
        """A unit some of whose parameters got no gradient this backward is released now, and the
        counts start afresh, so a short count never releases a unit in the middle of a backward."""
        self._callback_queued = False
        for unit, count in self.received.items():
            if count and not self.keep:
                self.store.release(unit)
        self.received = dict.fromkeys(self.received, 0)

    def release_all(self) -> None:
        """After the step: only the updated shards remain."""
        for u in range(len(self.store.units)):
            self.store.wait(u)
            self.store.release(u)
        self.received = dict.fromkeys(self.received, 0)


def _tensors(output):
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    if isinstance(output, dict):
        return [t for t in output.values() if isinstance(t, torch.Tensor)]
    return []
