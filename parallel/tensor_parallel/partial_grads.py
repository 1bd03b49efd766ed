"""Parameters whose gradient each tensor-parallel rank holds only in part, and their one sum.

Under sequence parallelism a norm's weight and bias, and a row-parallel layer's bias, are replicated
on every tensor rank, but each rank applies them to its own tokens only: its gradient is those
tokens' share, and the true gradient is the sum over the tensor group. Summing each parameter in
backward as it is produced costs a small all-reduce per parameter (six per transformer block), each
a synchronisation point on the tensor group's stream; for GPT 1.3B at tp 2 on H100 they took 11% of
the step (BENCHMARKS.md). So modules only record which of their parameters are partial
(``mark_partial``), and the sum is taken once for many of them together: by the data-parallel
wrapper, per gradient bucket just before its own reduction (``ParamInfo.tp_partial``), or by
``sum_partial_grads`` after backward for a model trained without that wrapper. Sums commute, so
summing over the tensor group whenever the data-parallel reduction runs (once per step after
accumulating micro-batches, or every backward under ZeRO 2/3's per-backward reduction) is exact.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

from parallel import comm

PARTIAL_ATTR = "tp_partial_grads"


def mark_partial(module: nn.Module, names: Iterable[str]) -> None:
    """Record that ``module``'s parameters ``names`` get only this rank's part of their gradient.

    The record lives on the module (like ``tp_shards``), so it survives ``Module.to_empty``."""
    setattr(module, PARTIAL_ATTR, set(getattr(module, PARTIAL_ATTR, set())) | set(names))


def partial_grad_names(model: nn.Module) -> set[str]:
    """Qualified names of every parameter of ``model`` whose gradient is summed over the tensor group."""
    return {f"{module_name}.{attr}" if module_name else attr
            for module_name, module in model.named_modules() for attr in getattr(module, PARTIAL_ATTR, ())}


def sum_partial_grads(model: nn.Module, group) -> None:
    """After backward, without the data-parallel wrapper: sum the partial gradients over ``group``."""
    names = partial_grad_names(model)
    comm.all_reduce_coalesced([p.grad for n, p in model.named_parameters() if n in names and p.grad is not None],
                              group)
