"""The data-parallel axis applied to one rank's model chunks: ZeRO's flat buffers, reductions and gathers.

``DataParallel`` takes the chunks a rank runs (already tensor-parallel, checkpointed and compiled)
and makes them a ZeRO replica:

=====  ==============================  =======================  ====================================
stage  16-bit parameters               gradients                shard the optimizer updates (fp32)
=====  ==============================  =======================  ====================================
0      whole                           whole, all-reduced       every element
1      whole                           whole, reduce-scattered  this rank's slice of every bucket
2      whole                           owned slice (buckets     this rank's slice of every bucket
                                       reduced every backward)
3      none: units gathered around     owned slice              this rank's slice of every bucket
       their forward/backward, each
       rank's slices rounded from the
       master as it gathers (offload:
       a rounded owned slice is kept)
=====  ==============================  =======================  ====================================

With ``once_per_step`` stages 2 and 3 keep whole gradients across micro-batches and reduce them
once at the step, and stage 3 keeps a unit gathered from its first use to the step: a pipeline
runs many micro-batches through each unit, and gathering or reducing for each would multiply the
communication by the micro-batch count; a split-backward schedule computes a unit's weight
gradients after the backward that would have released it.

It knows torch and process groups, nothing of optimizers: it hands over the fp32 values of the
shard (``take_initial_shard``), the reduced gradient of each shard segment, and takes new values
back (``load_shard``). An optimizer that updates late, unit by unit (ZeRO-Offload's host AdamW), is
attached as a ``DeferredUpdate``; every unit then goes through one sequence before it runs:
its pending update is applied and uploaded, the unit is gathered, and the compute stream waits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch
import torch.distributed as dist

from parallel.data_parallel.gather import Stage3Hooks
from parallel.data_parallel.grads import GradReducer
from parallel.data_parallel.host_copies import HostCopies
from parallel.data_parallel.layout import FlatLayout
from parallel.data_parallel.params import ParamStore
from parallel.data_parallel.storage import storage_bytes
from parallel.pipeline.grads import sum_tied_grads
from parallel.tensor_parallel.sharding import Shard

# 0: plain data parallelism; 1 shards the optimizer state, 2 also the gradients, 3 also the parameters
STAGES = (0, 1, 2, 3)


@dataclass
class DataParallelSettings:
    stage: int = 1  # one of STAGES
    bucket_numel: int = 200 * 2**20 // 4  # elements; the config's default of 200 MiB of fp32 gradients
    param_dtype: torch.dtype = torch.float32
    grad_dtype: torch.dtype = torch.float32
    overlap_comm: bool = True
    once_per_step: bool = False
    prefetch_depth: int = 1
    persistence_threshold: int = 0
    offload: bool = False  # the shard's optimizer lives in host memory (copies go on a stream of their own)


@dataclass(frozen=True)
class ParamInfo:
    """What the model says of one of its parameters, for reductions and checkpoints."""

    name: str  # logical name: the single-device model's (a tied head copy is named as the embedding)
    shard: Optional[Shard]  # the tensor-parallel slice of the logical tensor this rank holds
    counts_for_norm: bool  # False for tp-replicated copies off the first tp rank and a tied head copy
    tied: bool = False  # its gradient is summed with a copy on another pipeline stage first
    # its gradient is complete only at the step's end, so its buckets are reduced then (a tied copy;
    # an embedding whose head, under a split backward, adds its share in the deferred weight pass)
    late: bool = False
    tp_partial: bool = False  # this tensor rank holds only its tokens' share of the gradient (sequence
    # parallel norms and biases): summed over the tensor group before the data-parallel reduction


class DeferredUpdate(Protocol):
    """An optimizer that applies a step's update unit by unit, just before each unit is used."""

    def bucket_reduced(self, bucket: int) -> None:
        """Bucket ``bucket``'s reduced gradient slice is final for this step."""

    def pending_units(self) -> list[int]:
        """Units whose update is settled but not applied yet."""

    def update_unit(self, unit: int) -> bool:
        """Apply ``unit``'s pending update and write its 16-bit values back (``load_unit``); False
        when nothing was pending."""


class DataParallel:
    """ZeRO ``settings.stage`` over ``roots``' parameters on this data-parallel rank.

    ``units`` are submodules whose parameters are grouped (and, under stage 3, gathered) together,
    in forward order; the remaining parameters form one more unit kept gathered through a step.
    ``roots`` are the modules the caller invokes (pipeline chunks): under stage 3 their forward
    gathers that persistent unit. ``info(param)`` is the model's description of each parameter;
    ``tied_group`` is where tied parameters' gradients are summed before the data-parallel reduction,
    ``tp_group`` where the partial ones are (see ``parallel.tensor_parallel.partial_grads``).
    """

    def __init__(self, roots: list[torch.nn.Module], settings: DataParallelSettings, dp_group,
                 units: list[torch.nn.Module], info: Callable[[torch.nn.Parameter], ParamInfo], tied_group=None,
                 tp_group=None):
        if settings.stage not in STAGES:
            raise ValueError(f"ZeRO stage {settings.stage}: use one of {STAGES}")
        self.settings = s = settings
        self.dp_group = dp_group
        self.dp = dist.get_world_size(dp_group)
        self.dp_rank = dist.get_rank(dp_group)
        self.params, unit_modules, self.layout = flat_layout(roots, units, s, self.dp, self.dp_rank)
        self.info = [info(p) for p in self.params]
        if tp_group is None and any(inf.tp_partial for inf in self.info):
            raise ValueError("parameters with partial gradients (sequence-parallel norms and biases) need the "
                             "tensor-parallel group to sum them over: pass tp_group")
        self._initial_shard = self._read_shard()
        self.host_copies = HostCopies(self.params[0].device) if s.offload else None
        self.store = ParamStore(self.params, self.layout, s.param_dtype, dp_group, sharded=s.stage == 3,
                                host_copies=self.host_copies,
                                master=self._initial_shard if s.stage == 3 and not s.offload else None)
        sharded = s.stage >= 2 and not s.once_per_step
        self.reducer = GradReducer(self.params, self.layout, dp_group, s.grad_dtype,
                                   mode="sharded" if sharded else "full", reduce_scatter=s.stage > 0,
                                   on_final=self._bucket_final,
                                   partial=[i for i, inf in enumerate(self.info) if inf.tp_partial],
                                   partial_group=tp_group)
        self.tied_group = tied_group
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.tied = [i for i, inf in enumerate(self.info) if inf.tied]
        for i, inf in enumerate(self.info):
            if inf.tied or inf.late:
                self.reducer.defer(i)
        # The order the forward uses units in: the persistent one (embeddings) first, then the blocks.
        self.unit_order = ([u for u, m in enumerate(unit_modules) if m is None]
                           + [u for u, m in reversed(list(enumerate(unit_modules))) if m is not None])
        self.deferred: Optional[DeferredUpdate] = None
        self.stage3 = None
        names = {id(p): n for n, p in torch.nn.ModuleList(roots).named_parameters()}
        if s.stage == 3:
            self.stage3 = Stage3Hooks(roots, unit_modules, self.store, self.fetch, s.prefetch_depth,
                                      keep_until_step=s.once_per_step, names=names)
        else:
            self._wait_before_use(roots, unit_modules)

    def _read_shard(self) -> torch.Tensor:
        """The fp32 values of this rank's segments, read before parameters become 16-bit (into host
        memory when the optimizer is offloaded)."""
        device = torch.device("cpu") if self.settings.offload else self.params[0].device
        shard = torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=device)
        for seg in self.layout.segments:
            src = self.params[seg.param].detach().reshape(-1)[seg.param_offset:seg.param_offset + seg.numel]
            shard[seg.shard_offset:seg.shard_offset + seg.numel].copy_(src)
        return shard

    def take_initial_shard(self) -> torch.Tensor:
        """The shard's initial fp32 values, handed over once to the optimizer as its master."""
        shard, self._initial_shard = self._initial_shard, None
        if shard is None:
            raise RuntimeError("the initial shard was already taken: one optimizer per DataParallel")
        return shard

    def attach(self, deferred: DeferredUpdate) -> None:
        """Route every unit's use through ``deferred``'s late update (ZeRO-Offload)."""
        self.deferred = deferred

    # --- one unit's sequence before it runs: update (upload) -> gather -> wait ----------------
    def _update(self, unit: int) -> None:
        """Apply ``unit``'s deferred update if one is pending; stages 1-2 then start rebuilding the
        unit from every rank's slices (stage 3 gathers when the unit is fetched)."""
        if self.deferred is not None and self.deferred.update_unit(unit) and self.settings.stage in (1, 2):
            self.store.all_gather_unit(unit)

    def fetch(self, unit: int, async_op: bool = False) -> None:
        """Stage 3: bring ``unit`` up to date, then gather it (``store.wait`` completes an async one)."""
        self._update(unit)
        self.store.gather(unit, async_op)

    def _wait_before_use(self, roots, unit_modules) -> None:
        """Stages 0-2 leave the post-step all-gathers running, and an offloaded step leaves each unit's
        update to its next use: each unit is brought up to date just before its forward (the roots'
        forward for the persistent unit), so the gathers overlap the next step's compute."""
        persistent = [u for u, m in enumerate(unit_modules) if m is None]

        def before_use(unit: int) -> None:
            self._update(unit)
            self.store.wait(unit)

        def before_persistent(module, args):
            for u in persistent:
                before_use(u)
        for root in roots:
            root.register_forward_pre_hook(before_persistent)
        for u, module in enumerate(unit_modules):
            if module is not None:
                module.register_forward_pre_hook(lambda module, args, u=u: before_use(u))

    def apply_deferred(self) -> None:
        """Apply every pending unit's update (before the shard or the parameters are read outside a
        forward, and before a new step's gradients overwrite what a pending update reads)."""
        if self.deferred is not None:
            for unit in list(self.deferred.pending_units()):
                self._update(unit)

    def _bucket_final(self, b: int) -> None:
        if self.deferred is not None:
            self.apply_deferred()
            self.deferred.bucket_reduced(b)

    def wait_params(self) -> None:
        """Make every 16-bit parameter current, for code that reads them outside a forward."""
        self.apply_deferred()
        self.store.wait_all()
        if self.stage3 is not None:
            for unit in range(len(self.store.units)):
                self.store.gather(unit)

    # --- gradients ---------------------------------------------------------------------------
    def begin_microbatch(self, last: bool) -> None:
        """Optional: ``last=True`` before the final backward lets stages 0/1 overlap their reduction."""
        self.reducer.begin_microbatch(last and self.settings.overlap_comm)

    def add_weight_grad(self, weight: torch.Tensor, products: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Add ``sum a @ b`` to ``weight``'s gradient (a weight's or a bias's) straight into its fp32
        buffer, as if it had arrived through autograd (whole-gradient buffers: stages 0 and 1, and
        every stage in the ``once_per_step`` mode); False where that cannot be done in
        place (see ``GradReducer.add_products``): the caller then hands the gradient to autograd."""
        i = self.index.get(id(weight))
        return i is not None and self.reducer.add_products(i, products)

    def add_grad(self, param: torch.Tensor, grad: torch.Tensor) -> bool:
        """Add ``grad``, computed outside autograd (a split-backward schedule's sum over micro-batches,
        in fp32), to ``param``'s gradient as if it had arrived through autograd, but without autograd
        rounding it to the parameter's 16 bits first (whole-gradient buffers, as ``add_weight_grad``);
        False where it cannot be."""
        i = self.index.get(id(param))
        return i is not None and self.reducer.add_grad(i, grad)

    @property
    def grads_summed_over(self) -> int:
        """How many data-parallel ranks' gradients the reduced buffers hold the sum of, which the
        optimizer divides by: 1 where the reducer divided fp16 buffers before the sum."""
        return 1 if self.reducer.averages else self.dp

    def finish_reduction(self) -> None:
        """At the accumulation boundary: tied copies summed over the tied group (the pipeline's first
        and last stage), then every bucket reduced over the data-parallel group."""
        sum_tied_grads([self.reducer.accumulated_grad(i) for i in self.tied], self.tied_group)
        self.reducer.finish()

    def segment_grad(self, seg) -> torch.Tensor:
        """The reduced gradient (a sum over ranks) of one shard segment, valid after ``finish_reduction``."""
        return self.reducer.segment_grad(seg)

    def bucket_grad(self, b: int) -> torch.Tensor:
        return self.reducer.bucket_grad(b)

    def zero_grad(self) -> None:
        self.reducer.zero()

    # --- parameters after an update ----------------------------------------------------------
    def load_shard(self, master: torch.Tensor) -> None:
        """New fp32 values of the whole shard (on the parameters' device): round them into this rank's
        16-bit slices, then (stages 1-2) start every rank's all-gather; stage 3 releases its units."""
        self.before_owned_write()
        self.store.load_owned(master, self.unit_order)
        self.publish_owned()

    def before_owned_write(self) -> None:
        """Before new values overwrite this rank's 16-bit slices: order the stream after any all-gather
        still reading them (stages 1-2: a unit no forward has used since its last gather; stage 3: a
        prefetched unit nothing used, which the end of the step releases anyway)."""
        if self.settings.stage > 0:
            self.store.wait_all()

    def owned_params(self, b: int) -> Optional[torch.Tensor]:
        """Where this rank's 16-bit slice of bucket ``b`` lives (what ``load_shard`` writes), for an
        update that rounds into the parameters itself (after ``before_owned_write``); None under
        stage 3 with the master on the device, which keeps no rounded slice."""
        return self.store.owned_slice(self.layout.buckets[b])

    def publish_owned(self) -> None:
        """This rank's 16-bit slices hold the step's new values: start the stage 1-2 all-gathers, and
        release stage 3's gathered units."""
        if self.settings.stage in (1, 2):
            self.store.all_gather_buckets(self.unit_order)
        self.end_step()

    def load_unit(self, host_master: torch.Tensor, unit: int) -> None:
        """New fp32 values of ``unit``'s slices from a host-resident shard (a deferred update)."""
        self.store.load_unit(host_master, unit)

    def end_step(self) -> None:
        """Stage 3: after the step only the updated shards remain."""
        if self.stage3 is not None:
            self.stage3.release_all()

    # --- inspection --------------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """Bytes of 16-bit parameters and of gradient buffers this rank holds (whole gradient buffers
        counted whole: they are released between steps, held within one)."""
        return {"params": storage_bytes(self.params + [self.store.shard]),
                "grads": self.reducer.held_bytes()}


def flat_layout(roots: list[torch.nn.Module], units: list[torch.nn.Module], settings: DataParallelSettings, dp: int,
                dp_rank: int) -> tuple[list[torch.nn.Parameter], list, FlatLayout]:
    """``roots``' trainable parameters in flat-buffer order, the module of each unit (None for the
    persistent one) and the layout of data-parallel rank ``dp_rank`` of ``dp``. Only shapes are read,
    so meta-device models describe a layout without a process group (an offline checkpoint)."""
    named = [(n, p) for n, p in torch.nn.ModuleList(roots).named_parameters() if p.requires_grad]
    unit_params, unit_modules = _group_by_unit(named, units, settings.persistence_threshold)
    order = [i for members in unit_params for i in members]
    sharded = settings.stage > 0  # stage 0 keeps the whole buffers on every rank
    layout = FlatLayout([[named[i][1].numel() for i in members] for members in unit_params],
                        settings.bucket_numel, dp if sharded else 1, dp_rank if sharded else 0)
    return [named[i][1] for i in order], unit_modules, layout


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
