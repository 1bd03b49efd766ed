"""Which slice of a logical (single-device) tensor a tensor-parallel parameter holds.

Parallel layers record a ``Shard`` per sharded parameter in their ``tp_shards`` dict (keyed by the
parameter's attribute name). The record lives on the module, not on the tensor, so it survives
``Module.to_empty`` (which replaces meta parameters with new tensor objects). Initialisation,
checkpoint conversion and tests use it to map between the local slice and the full tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Shard:
    """This rank holds part ``index`` of ``count`` equal contiguous parts along ``dim``."""

    dim: int
    index: int
    count: int

    def full_shape(self, local_shape: torch.Size) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] *= self.count
        return tuple(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``full`` (a view)."""
        if full.shape[self.dim] % self.count:
            raise ValueError(f"dimension {self.dim} of size {full.shape[self.dim]} does not split into "
                             f"{self.count} equal parts")
        return full.chunk(self.count, dim=self.dim)[self.index]


def param_shards(model: nn.Module) -> dict[str, Shard]:
    """Every sharded parameter of ``model`` by its qualified name; absent names are replicated."""
    shards = {}
    for module_name, module in model.named_modules():
        for attr, shard in getattr(module, "tp_shards", {}).items():
            shards[f"{module_name}.{attr}" if module_name else attr] = shard
    return shards
