"""Collecting gradients as backward produces them, and reducing them over the data-parallel group.

Two ways to hold them, chosen by the ZeRO stage:

* ``full``: one flat buffer per unit for all its gradients (in the accumulation dtype, fp32 by
  default), written by each parameter's post-accumulate hook so 16-bit gradients never pile up
  in ``.grad``. At the accumulation boundary each bucket is all-reduced (stage 0) or
  reduce-scattered in place (stage 1: the rank keeps the summed values of its own slice). With
  ``begin_microbatch(last=True)`` the reductions start inside the last backward, bucket by bucket,
  as soon as every gradient of a bucket has arrived. A unit's buffer holds memory only from its
  first gradient of a step to the step's end: ``zero`` releases the storage (views into it stay
  valid, as stage 3's parameters do) and the next backward takes it back when it reaches the unit.
  The forward then runs without the gradients' 4 bytes per parameter, and the backward takes them
  back unit by unit as it frees the activations, so a one-micro-batch step peaks lower by about
  the whole gradient buffer (1.3B GPT: 4.9 GiB).
* ``sharded`` (stages 2 and 3): a bucket-sized scratch buffer is taken from a small pool when a
  bucket's first gradient arrives and reduce-scattered as soon as its last one does, every
  micro-batch; only the rank's own slice is kept, summed into the gradient shard. Memory is the
  shard plus a few constant-size buckets, whatever the model size.

Buffers are never cleared: the first gradient a region receives after ``zero`` is copied in
(converting 16 to 32 bits on the way) and only later ones are added, and the first reduction of a
bucket in sharded mode writes straight into the shard. That saves a fill and a read of every
buffer per step on the backward's critical path. Those copies land in batches, one
``_foreach_copy_`` for the gradients that arrived since the last batch (before a bucket is reduced,
once a bucket's worth is waiting, and at the end of each backward): torch's casting copy of one
tensor moves half the bytes per second of the batched kernel (on an H200, a 1.3B model's gradients
took 4.8 ms one tensor at a time, 3.4 ms in per-tensor foreach calls and 2.5 ms in one call), and
issuing one launch for many tensors also saves host time. Adds land at once: a batched add of mixed
dtypes is no faster. Whatever received nothing (a parameter unused
this step) is zeroed when its bucket is reduced, so a stale value never leaks into a step. Gaps
between parameters (alignment padding) may hold stale values in a reused scratch buffer; they
reduce into shard gaps, which no segment reads.

Gradients that a tensor rank holds only in part (``partial``: sequence-parallel norms and biases)
are summed over ``partial_group`` as their bucket is launched, all of a bucket's in one collective,
just before the data-parallel reduction reads them.

Reductions are sums: dividing by the data-parallel size is folded into the optimizer's single
unscale-and-clip multiply (``DataParallel.grads_summed_over``), except in fp16 buffers, which are
divided before the sum (``averages``). Buckets are launched in the same order on every rank
(backward order, then bucket index for stragglers), so collectives never cross. That needs the usual data-parallel
contract: in a step, every rank's backward reaches the same parameters (a parameter may go unused,
but then on every rank), as it does for a GPT, whose every parameter is used by every token.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from parallel.data_parallel.hooks import add_grad_hook
from parallel.data_parallel.layout import Bucket, FlatLayout
from parallel.data_parallel.storage import holds_storage, release_storage, storage_bytes, take_storage
from parallel import comm
from parallel.matmul import can_matmul_into, matmul_into


MAX_IN_FLIGHT = 2
"""Bucket reductions left running while the backward goes on. Sharded mode holds a scratch buffer for
each, and one for each bucket still filling: the current one, and any a gradient arriving out of the
layout's order keeps open (the planner counts one such, as measured: ``SCRATCH_BUCKETS``)."""


class GradReducer:
    def __init__(self, params: list[torch.nn.Parameter], layout: FlatLayout, group, dtype: torch.dtype,
                 mode: str, reduce_scatter: bool, on_final: Optional[Callable[[int], None]] = None,
                 max_in_flight: int = MAX_IN_FLIGHT, partial: Sequence[int] = (), partial_group=None):
        assert mode in ("full", "sharded")
        self.params, self.layout, self.group, self.dtype, self.mode = params, layout, group, dtype, mode
        self.reduce_scatter, self.max_in_flight = reduce_scatter, max_in_flight
        # fp16's range is 65504: gradients that each fit can sum over the ranks to an inf where one
        # process (whose gradient is their mean) trains on, so fp16 buffers are divided by dp before
        # the sum, as Megatron-LM scales its gradients; the others sum, and the optimizer divides
        self.ranks = comm.group_size(group)
        self.averages = dtype == torch.float16 and self.ranks > 1
        device = params[0].device
        self.needed = [layout.bucket_param_numel(b) for b in layout.buckets]
        self.bucket_index = {b: i for i, b in enumerate(layout.buckets)}
        self.param_buckets = [[self.bucket_index[b] for b in layout.param_buckets(i)] for i in range(len(params))]
        self.received = [0] * len(layout.buckets)
        self.launched = [False] * len(layout.buckets)
        # written: a parameter's region holds this step's (full) or this backward's (sharded) gradient;
        # reduced: a bucket's shard slice holds this step's sum (sharded)
        self.written = [False] * len(params)
        self.reduced = [False] * len(layout.buckets)
        self.in_flight: list[tuple[int, object, torch.Tensor | None, bool]] = []  # (bucket, handle, scratch, add)
        self.pool: list[torch.Tensor] = []
        self.scratch: dict[int, torch.Tensor] = {}
        self.overlap = False
        self.final = False  # this backward is the step's last: a reduced bucket is final
        self.on_final = on_final  # told when a bucket's step sum is complete (in the step's last backward)
        self.deferred: set[int] = set()  # buckets that must wait for finish() (see defer)
        self._callback_queued = False
        self.partial_group = partial_group
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, gradient) not yet landed
        self.copying: set[int] = set()  # parameters with a copy in ``copies``
        self.copying_numel = 0
        # a bucket's worth, at most 16M elements (32 MiB of 16-bit gradients held)
        self.land_numel = min(max(bucket.numel for bucket in layout.buckets), 1 << 24)
        self.bucket_partial = [[i for i in partial if b in self.param_buckets[i]] for b in range(len(layout.buckets))]
        self.unit_flat: list[torch.Tensor] = []  # full mode: each unit's buffer (released between steps)
        self.shard = None
        if mode == "full":
            self.unit_flat = [torch.empty(n, dtype=dtype, device=device) for n in layout.unit_numel]
            # made while the storage is there (a released one takes no new views); they stay valid
            self.segment_views = {seg: self.param_grad(seg.param)[seg.param_offset:seg.param_offset + seg.numel]
                                  for seg in layout.segments}
            self.gap_views = [self._gaps(u) for u in range(len(layout.unit_numel))]
            self._release()
        else:
            self.shard = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
        for i, p in enumerate(params):
            add_grad_hook(p, self, type(self)._grad_arrived, i)

    # --- views the optimizer reads -----------------------------------------------------------
    def segment_grad(self, seg) -> torch.Tensor:
        """The reduced gradient of one owned segment (valid after ``finish``, until ``zero``): the same
        view every step."""
        if self.mode == "sharded":
            return self.shard[seg.shard_offset:seg.shard_offset + seg.numel]
        return self.segment_views[seg]

    # --- backward ----------------------------------------------------------------------------
    def begin_microbatch(self, last: bool) -> None:
        """``last=True`` lets full-mode reductions start during this backward (the final one), and
        ``on_final`` hear of each bucket as it completes."""
        self.overlap = last and self.mode == "full"
        self.final = last

    def bucket_grad(self, b: int) -> torch.Tensor:
        """This rank's reduced slice of bucket ``b`` (complete after ``finish``, or after ``on_final(b)``)."""
        bucket = self.layout.buckets[b]
        if self.mode == "sharded":
            return self._shard_slice(bucket)
        return self._flat(bucket.unit, *self.layout.owned_range(bucket))

    def _flat(self, unit: int, lo: int, hi: int) -> torch.Tensor:
        """Elements ``lo:hi`` of ``unit``'s full-mode buffer, whose storage is taken back first if the
        step has not touched the unit yet. Retaken memory holds whatever the allocator had there: a
        parameter's region is written before it is read (copied into, or zeroed when it got no
        gradient), and the padding between and after parameters is zeroed here, so collectives and
        copies of whole buckets never carry stale values (nor trip a NaN check)."""
        buf = self.unit_flat[unit]
        if not holds_storage(buf):
            take_storage(buf)
            if self.gap_views[unit]:
                torch._foreach_zero_(self.gap_views[unit])
        return buf[lo:hi]

    def _gaps(self, unit: int) -> list[torch.Tensor]:
        """Views of ``unit``'s padding: what no parameter covers."""
        gaps, end = [], 0
        for i in self.layout.unit_params[unit]:
            start = self.layout.param_offset[i]
            if start > end:
                gaps.append(self.unit_flat[unit][end:start])
            end = start + self.layout.param_numel[i]
        if end < self.layout.unit_numel[unit]:
            gaps.append(self.unit_flat[unit][end:])
        return gaps

    def _release(self) -> None:
        """Give every full-mode buffer's memory back to the allocator until the next step needs it.
        Safe without waiting: the work that read a buffer was queued on this stream, or waited for
        on it (``zero`` waits for reductions still in flight), or on the host (offloaded copies)."""
        for buf in self.unit_flat:
            release_storage(buf)

    def held_bytes(self) -> int:
        """The gradient memory of a step: full-mode buffers count whole (they are released between
        steps, but held from the backward that reaches them to the end of the step)."""
        full = sum(buf.numel() * buf.element_size() for buf in self.unit_flat)
        return full + storage_bytes([self.shard, *self.pool])

    def _grad_arrived(self, i: int, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        self._accumulate(i, param.grad)
        param.grad = None

    def _bucket_slice(self, i: int, b: int) -> tuple[int, int, int]:
        """(start in the parameter, start in the bucket, length) of parameter i's part of bucket b."""
        bucket = self.layout.buckets[b]
        lo = max(self.layout.param_offset[i], bucket.start)
        hi = min(self.layout.param_offset[i] + self.layout.param_numel[i], bucket.end)
        return lo - self.layout.param_offset[i], lo - bucket.start, hi - lo

    def _accumulate(self, i: int, grad: torch.Tensor) -> None:
        grad = grad.reshape(-1)
        first = not self.written[i]
        self.written[i] = True
        if i in self.copying:  # its earlier gradient must be in place before this one
            self._land()
        if self.mode == "full":
            region = self.param_grad(i)
            self._copy(i, region, grad) if first else region.add_(grad)
            self._arrived(i)
            return
        for b in self.param_buckets[i]:  # sharded: one gradient per backward, which flushes them all
            src, dst, n = self._bucket_slice(i, b)
            if b not in self.scratch:
                self.scratch[b] = self._take_buffer()
            self._copy(i, self.scratch[b][dst:dst + n], grad[src:src + n])
            self._count(b, n)

    def _arrived(self, i: int) -> None:
        """Full mode: parameter i's gradient of this backward is in its region."""
        if self.overlap:
            for b in self.param_buckets[i]:
                self._count(b, self._bucket_slice(i, b)[2])

    def add_products(self, i: int, products: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Add ``sum a @ b`` over ``products`` to parameter i's gradient in its region, the GEMMs
        accumulating in the buffer's dtype, as if that sum had arrived through the parameter's hook;
        False (nothing done) where this cannot be done in place: no products, sharded mode, a 16-bit
        buffer, or 16-bit factors off CUDA. A product of another shape than the parameter's raises
        ValueError.

        This is the split-backward schedules' weight gradient (``pipeline.deferred_wgrad``): computed
        outside autograd anyway, it can skip the 16-bit product, the hook and the separate
        conversion and add of every micro-batch's gradient into fp32 (gradient accumulation fused
        into the GEMM, as Megatron-LM does for its ``main_grad``).
        """
        if not products or self.mode != "full" or not all(can_matmul_into(self.dtype, a, b) for a, b in products):
            return False
        if i in self.copying:
            self._land()
        param = self.params[i]
        region = self.param_grad(i).view(param.shape if param.dim() > 1 else (1, param.numel()))  # a bias: a row
        wrong = next(((a, b) for a, b in products if (a.shape[0], b.shape[1]) != region.shape), None)
        if wrong is not None:  # a GEMM's out= would reshape the view and write another layout's values
            raise ValueError(f"a product of shape ({wrong[0].shape[0]}, {wrong[1].shape[1]}) for parameter {i} "
                             f"of shape {tuple(param.shape)}")
        with torch.no_grad():  # the factors are saved activations, which may require grad
            for k, (a, b) in enumerate(products):
                matmul_into(region, a, b, accumulate=self.written[i] or k > 0)
        self.written[i] = True
        self._arrived(i)
        return True

    def add_grad(self, i: int, grad: torch.Tensor) -> bool:
        """Add ``grad`` to parameter i's gradient in its region, as its hook would, in whatever dtype it
        comes (a sum over micro-batches in fp32 stays unrounded in an fp32 buffer); False in sharded
        mode, whose per-backward reduction runs only from within a backward."""
        if self.mode != "full":
            return False
        self._accumulate(i, grad.detach())  # computed from saved activations, which may require grad
        return True

    def _copy(self, i: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``, in the next batch (see the module doc)."""
        self.copies.append((dst, src))
        self.copying.add(i)
        self.copying_numel += src.numel()
        if self.copying_numel >= self.land_numel:
            self._land()

    def _land(self) -> None:
        """Do the queued copies, one launch for all of them."""
        if self.copies:
            destinations, gradients = zip(*self.copies)
            torch._foreach_copy_(list(destinations), list(gradients))
            self._forget_copies()

    def _forget_copies(self) -> None:
        self.copies.clear()
        self.copying.clear()
        self.copying_numel = 0

    def defer(self, param: int) -> None:
        """Keep the buckets holding ``param`` out of early reduction: the caller first combines its
        gradient with another copy (a tied embedding on another pipeline stage) in ``finish``."""
        if self.mode == "sharded":
            raise ValueError("a deferred (tied) parameter needs whole gradients until the step: "
                             "use the once-per-step mode of ZeRO stages 2 and 3 with pipeline parallelism")
        self.deferred.update(self.param_buckets[param])

    def param_grad(self, i: int) -> torch.Tensor:
        """Parameter i's region of the flat buffer (full mode): its accumulated gradient once written."""
        start = self.layout.param_offset[i]
        return self._flat(self.layout.param_unit[i], start, start + self.layout.param_numel[i])

    def accumulated_grad(self, i: int) -> torch.Tensor:
        """Parameter i's whole gradient so far (full mode, before ``finish``): zero if none arrived."""
        if not self.written[i]:
            self.param_grad(i).zero_()
            self.written[i] = True
        self._land()
        return self.param_grad(i)

    def _shard_slice(self, bucket: Bucket) -> torch.Tensor:
        lo, hi = self.layout.shard_range(bucket)
        return self.shard[lo:hi]

    def _clear_unwritten(self, b: int) -> None:
        """Zero the parts in ``b`` of parameters that sent no gradient, before ``b`` is reduced (only
        those parts: the parameter's other buckets may be in flight already)."""
        for i in self.layout.unit_params[self.layout.buckets[b].unit]:
            if not self.written[i] and b in self.param_buckets[i]:
                src, dst, n = self._bucket_slice(i, b)
                if self.mode == "full":
                    self.param_grad(i)[src:src + n].zero_()
                else:
                    self.scratch[b][dst:dst + n].zero_()

    def _count(self, b: int, n: int) -> None:
        self.received[b] += n
        if self.received[b] == self.needed[b] and b not in self.deferred:
            self._launch(b)

    def _take_buffer(self) -> torch.Tensor:
        if self.pool:
            return self.pool.pop()
        # as large as the largest bucket: smaller than the setting when every unit is smaller
        largest = max(bucket.numel for bucket in self.layout.buckets)
        return torch.zeros(largest, dtype=self.dtype, device=self.shard.device)

    def _sum_partial(self, b: int) -> None:
        """Sum the partial gradients in bucket ``b`` over the tensor group (one collective)."""
        if not self.bucket_partial[b]:
            return
        regions = []
        for i in self.bucket_partial[b]:
            src, dst, n = self._bucket_slice(i, b)
            regions.append(self.param_grad(i)[src:src + n] if self.mode == "full" else self.scratch[b][dst:dst + n])
        comm.all_reduce_coalesced(regions, self.partial_group)

    def _launch(self, b: int) -> None:
        bucket = self.layout.buckets[b]
        self._land()
        self._sum_partial(b)
        if self.mode == "full":
            buf = self._flat(bucket.unit, bucket.start, bucket.end)
            if self.averages:
                buf.div_(self.ranks)
            if self.reduce_scatter:
                handle = comm.reduce_scatter_into(self.bucket_grad(b), buf, self.group, async_op=True)
            else:
                handle = comm.all_reduce(buf, self.group, async_op=True)
            self.in_flight.append((b, handle, None, False))
        else:
            scratch = self.scratch.pop(b)
            size = bucket.numel // self.layout.dp
            # The step's first reduction of a bucket lands in the shard directly; a later micro-batch's
            # is reduced in place and added to the shard when complete.
            add = self.reduced[b]
            out = scratch[self.layout.dp_rank * size:(self.layout.dp_rank + 1) * size] if add else self._shard_slice(bucket)
            self.reduced[b] = True
            if self.averages:
                scratch[:bucket.numel].div_(self.ranks)
            handle = comm.reduce_scatter_into(out, scratch[:bucket.numel], self.group, async_op=True)
            self.in_flight.append((b, handle, scratch, add))
        self.launched[b] = True
        while len(self.in_flight) > self.max_in_flight:
            self._complete(self.in_flight.pop(0))

    def _complete(self, item) -> None:
        b, handle, scratch, add = item
        if handle is not None:
            handle.wait()  # also orders the scratch buffer's reuse after the collective that reads it
        if add:
            shard = self._shard_slice(self.layout.buckets[b])
            rank_lo = self.layout.dp_rank * shard.numel()
            shard.add_(scratch[rank_lo:rank_lo + shard.numel()])
        if scratch is not None:
            self.pool.append(scratch)
        if self.final and self.on_final is not None:
            self.on_final(b)

    def _flush(self) -> None:
        self._land()
        for b in range(len(self.layout.buckets)):
            if not self.launched[b] and (self.mode == "full" or b in self.scratch):
                self._clear_unwritten(b)
                self._launch(b)
        while self.in_flight:
            self._complete(self.in_flight.pop(0))
        self.received = [0] * len(self.layout.buckets)
        self.launched = [False] * len(self.layout.buckets)
        if self.mode == "sharded":  # each backward fills fresh scratch buffers
            self.written = [False] * len(self.params)

    def _end_of_backward(self) -> None:
        """Land what this backward queued, so no gradient is held into the next forward (where it
        would also keep a CUDA-graph block's outputs alive); in sharded mode also reduce every
        bucket, as each backward fills fresh scratch buffers."""
        self._callback_queued = False
        if self.mode == "sharded":
            self._flush()
        else:
            self._land()

    def finish(self) -> None:
        """At the accumulation boundary: every bucket reduced, every handle waited on. (In sharded mode
        the end-of-backward callback already flushed; this also covers a backward that raised.)"""
        self._flush()
        self.overlap = self.final = False
        self._callback_queued = False
        for b, bucket in enumerate(self.layout.buckets):
            if self.mode == "sharded" and not self.reduced[b]:  # no gradient reached it this step
                self._shard_slice(bucket).zero_()
                self.reduced[b] = True

    def zero(self) -> None:
        """Start a new step: nothing is cleared, every region is marked unwritten and the full-mode
        buffers are released (see the module doc). What a backward left behind without ``finish`` (one
        that raised, or a step skipped by calling ``zero`` alone) is dropped: queued copies, and
        reductions in flight, which are waited for first, since they still read or write buffers
        about to be released."""
        self._forget_copies()
        for _, handle, scratch, _ in self.in_flight:
            if handle is not None:
                handle.wait()
            if scratch is not None:
                self.pool.append(scratch)
        self.in_flight.clear()
        self.overlap = self.final = False
        self._callback_queued = False
        self._release()
        self.pool.extend(self.scratch.values())
        self.scratch.clear()
        self.received = [0] * len(self.layout.buckets)
        self.launched = [False] * len(self.layout.buckets)
        self.written = [False] * len(self.params)
        self.reduced = [False] * len(self.layout.buckets)
