"""Column- and row-parallel linear layers and the vocabulary-parallel embedding.

Each is built from the single-device module it replaces (``from_linear`` / ``from_embedding``),
keeping the parameter names ``weight`` and ``bias`` so state-dict keys do not change, and records
which slice of the full tensor it holds in ``tp_shards`` (see ``sharding``). Built from a module on
the meta device, they stay on the meta device: only the shard is ever materialised.

Communication, with ``sp`` = sequence parallel (under sp both linears are the single operators of
``overlap``, which gather and reduce-scatter tokens in the layer's ``comm_mode``; a schedule that
defers weight gradients runs the same operators' halves through its ``weight_grads``):

- ColumnParallelLinear: input copy_to_tp (sp: tokens all-gathered); output stays split by columns.
- RowParallelLinear: input is split by columns; output reduce_from_tp (sp: tokens reduce-scattered),
  then the bias, which under sp sees only this rank's tokens: its gradient is marked partial
  (``partial_grads``) and summed over the group with the gradient reduction.
- VocabParallelEmbedding: each rank looks up the ids in its vocabulary range, zeros the rest, and the
  partial embeddings are summed with reduce_from_tp.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel import comm
from parallel.tensor_parallel.collectives import copy_to_tp, reduce_from_tp
from parallel.tensor_parallel.overlap import column_linear, row_linear
from parallel.tensor_parallel.partial_grads import mark_partial
from parallel.tensor_parallel.sharding import Shard


def _shard_param(param: Optional[nn.Parameter], shard: Shard, memo: dict) -> Optional[nn.Parameter]:
    """This rank's part of ``param`` as a new parameter; a parameter shared by several modules
    (a tied embedding and head) is split once and stays shared."""
    if param is None:
        return None
    if id(param) not in memo:
        memo[id(param)] = (nn.Parameter(shard.take(param.detach()).clone(), requires_grad=param.requires_grad), shard)
    new, first_shard = memo[id(param)]
    if first_shard != shard:
        raise ValueError(f"a shared parameter is split two ways ({first_shard} and {shard}); "
                         "tied weights must use the same tensor-parallel style")
    return new


class _TPModule(nn.Module):
    SPLIT_DIMS: dict[str, Optional[int]] = {}
    """Each parameter's split dimension (None: replicated); also read by ``apply.shard_meta_model``."""

    def __init__(self, group, sequence_parallel: bool):
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.tp_shards: dict[str, Shard] = {}

    @classmethod
    def _from(cls, module: nn.Module, group, sequence_parallel: bool, memo, **init):
        """This rank's layer from a plain ``module``: each named parameter split along its dim."""
        layer = cls(group, sequence_parallel, **init)
        memo = {} if memo is None else memo
        for name, dim in cls.SPLIT_DIMS.items():
            layer._place(name, getattr(module, name), dim, memo)
        return layer

    def _place(self, name: str, param: Optional[nn.Parameter], dim: Optional[int], memo: dict) -> None:
        """Register this rank's part of ``param`` split along ``dim`` (None: replicated)."""
        if dim is None or param is None:
            setattr(self, name, param)
            return
        shard = Shard(dim, dist.get_rank(self.group), comm.group_size(self.group))
        if param.shape[dim] % shard.count:
            raise ValueError(f"{type(self).__name__}.{name}: dimension {dim} of size {param.shape[dim]} is not "
                             f"divisible by the tensor-parallel size {shard.count}")
        setattr(self, name, _shard_param(param, shard, memo))
        self.tp_shards[name] = shard

    def extra_repr(self) -> str:
        return f"tp={comm.group_size(self.group)}, sequence_parallel={self.sequence_parallel}"


class Linears(Protocol):
    """The products a tensor-parallel linear runs, which decide where its weight (and bias) gradients
    are computed: in backward (``IN_BACKWARD``), or later by a split-backward pipeline schedule
    (``parallel.pipeline.deferred_wgrad.WeightGradQueue``)."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor: ...

    def column_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group,
                      mode: str) -> torch.Tensor: ...

    def row_linear(self, x: torch.Tensor, weight: torch.Tensor, group, mode: str) -> torch.Tensor: ...


class _InBackward:
    linear = staticmethod(F.linear)
    column_linear = staticmethod(column_linear)
    row_linear = staticmethod(row_linear)


IN_BACKWARD: Linears = _InBackward()
"""The plain products: every gradient computed in backward."""


class _TPLinear(_TPModule):
    """A tensor-parallel linear; under sequence parallelism ``comm_mode`` (one of ``overlap.MODES``)
    says how its collectives are ordered around its products and what moves the tokens.
    ``weight_grads`` runs its products: ``IN_BACKWARD``, or a split-backward pipeline schedule's
    queue, which takes the weight gradients out of backward."""

    def __init__(self, group, sequence_parallel: bool, comm_mode: str = "overlap"):
        super().__init__(group, sequence_parallel)
        self.comm_mode = comm_mode
        self.weight_grads: Linears = IN_BACKWARD

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, sequence_parallel: bool = False, memo=None,
                    comm_mode: str = "overlap"):
        return cls._from(linear, group, sequence_parallel, memo, comm_mode=comm_mode)


class ColumnParallelLinear(_TPLinear):
    """y = x W^T + b with W's output rows (and b) split across ranks; y stays split."""

    SPLIT_DIMS = {"weight": 0, "bias": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return self.weight_grads.column_linear(x, self.weight, self.bias, self.group, self.comm_mode)
        return self.weight_grads.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(_TPLinear):
    """y = sum over ranks of x_r W_r^T, + b: input columns split, output whole (or sequence-split)."""

    SPLIT_DIMS = {"weight": 1, "bias": None}

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, sequence_parallel: bool = False, memo=None,
                    comm_mode: str = "overlap"):
        layer = super().from_linear(linear, group, sequence_parallel, memo, comm_mode)
        if sequence_parallel and layer.bias is not None:
            mark_partial(layer, ["bias"])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = self.weight_grads.row_linear(x, self.weight, self.group, self.comm_mode)
        else:
            y = reduce_from_tp(self.weight_grads.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(_TPModule):
    """Embedding whose vocabulary rows are split across ranks; the output is whole on every rank."""

    SPLIT_DIMS = {"weight": 0}

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group, sequence_parallel: bool = False, memo=None):
        return cls._from(embedding, group, sequence_parallel, memo)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        start = self.tp_shards["weight"].index * rows
        local = ids - start
        outside = (local < 0) | (local >= rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)
