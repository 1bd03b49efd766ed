"""Runs a pipeline schedule: this rank's forwards and backwards over the micro-batches of one step.

The executor knows nothing of the model. It holds this rank's model chunks (one, or ``v`` for
interleaved 1F1B) and calls ``forward_step(module, x, microbatch, first, last)`` for each forward:
``x`` is the activation received from the previous virtual stage (``None`` on the first), and on the
last virtual stage the call returns the micro-batch's mean loss. Backward of a stage starts from its
output with the gradient received from the next stage. Gradients accumulate in ``.grad``; reducing
them over data-parallel ranks (and summing tied embeddings) is the caller's next move, see ``grads``.

Split-backward schedules (``zb-h1``, ``zb-h2``, ``interleaved_zb``): the executor routes its chunks'
linear layers through a ``WeightGradQueue`` (``deferred_wgrad``), so a ``B`` op computes input
gradients and queues the weight-gradient GEMMs, and the ``W`` op of that micro-batch runs them. The
``W`` ops that follow a rank's last ``B`` run as one sum per weight: each parameter then receives
exactly one gradient after ``before_backward(op, is_last=True)``, which is what lets a data-parallel
reducer launch a bucket as soon as its last gradient lands, during that tail.

Memory: a forward's output is cloned into a fresh send buffer, and that buffer's storage is released
as soon as the send completes (autograd keeps only the graph, which never saved the clone), so a
stage holds just what its backward needs for the micro-batches in flight.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from parallel.pipeline.deferred_wgrad import WeightGradQueue, WeightGradSink, defer_weight_grads
from parallel.pipeline.p2p import StageLink, broadcast_from_last_stage, free_storage
from parallel.pipeline.placement import holder_of, neighbours, placement_of, stage_of
from parallel.pipeline.plan import Message, StageCosts, boundary_message, channels, plan_for
from parallel.pipeline.schedule import Op, build_schedule, default_schedule, splits_backward

ForwardStep = Callable[[nn.Module, Optional[torch.Tensor], Any, bool, bool], torch.Tensor]


def default_forward_step(module: nn.Module, x: Optional[torch.Tensor], microbatch: Any, first: bool,
                         last: bool) -> torch.Tensor:
    """``microbatch`` is ``(inputs, targets)``: the first stage eats inputs, the last returns a loss."""
    inputs, targets = microbatch
    args = (inputs if first else x,) + ((targets,) if last else ())
    return module(*args)


@dataclass
class StepStats:
    """What one step did on this rank, for tests and benchmarks."""

    ops: list[Op] = field(default_factory=list)  # in the order they ran
    peak_live: int = 0  # most micro-batch chunks held between their forward and backward (its W when split)
    peak_held_bytes: int = 0  # most bytes of stage outputs held for backward (unsent ones; sent ones are freed)
    sent: int = 0  # tensors sent to neighbours
    released: int = 0  # sent tensors whose storage was released after their send completed
    deferred: int = 0  # weight gradients of linear layers computed at W ops, apart from their B
    deferred_in_place: int = 0  # of those, added straight into the data-parallel buffers (the sink)
    compute_s: float = 0.0  # time inside forward/backward (only when the executor profiles)
    # profiled: each op's (start, end) in seconds from the first op's start, and when that start was on
    # the host's wall clock (``time.time()``, shared by the ranks of a machine, to about 0.1 ms on a
    # GPU): the ranks' timelines then line up, so one rank's wait shows against the other's ops
    op_times: list[tuple[float, float]] = field(default_factory=list)
    first_op_at: float = 0.0
    step_s: float = 0.0  # wall time of the step (GPU work included when profiling)

    @property
    def bubble(self) -> float:
        """Idle over busy time of a profiled step: what ``schedule.bubble_fraction`` predicts."""
        return (self.step_s - self.compute_s) / self.compute_s


class PipelineExecutor:
    """Runs ``schedule`` for one pipeline rank of ``topo``; ``chunks[c]`` is virtual stage ``c*pp + rank``,
    or under a V-shaped schedule (zb-v) ``placement.stage_of``'s: stage ``rank`` and ``2 pp - 1 - rank``.

    ``activation_shape`` is the shape of every tensor crossing a stage boundary on this rank: under
    sequence parallelism, the sequence-sharded one.
    """

    def __init__(self, chunks: Sequence[nn.Module], topo, activation_shape: Sequence[int],
                 dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None,
                 schedule: Optional[str] = None, forward_step: ForwardStep = default_forward_step,
                 timeout_s: float = 300.0, profile: bool = False,
                 before_backward: Optional[Callable[[Op, bool], None]] = None,
                 weight_grad_sink: Optional[WeightGradSink] = None, op_costs: Optional[StageCosts] = None,
                 costs_at: Optional[int] = None):
        if not chunks:
            raise ValueError("a pipeline rank needs at least one model chunk")
        self.chunks, self.topo = list(chunks), topo
        self.pp, self.rank, self.v = topo.pp_size, topo.pp_rank, len(self.chunks)
        self.schedule = schedule or default_schedule(self.pp, self.v)
        self.placement = placement_of(self.schedule)
        # the rank holding the last virtual stage computes the loss
        self.loss_rank = holder_of(self.pp, self.pp * self.v - 1, self.placement)[0]
        self.device = device or torch.device("cpu")
        self.forward_step, self.profile = forward_step, profile
        # every rank's op costs, by which a split-backward schedule times its weight gradients
        # (``plan.weight_grad_delays``); the same on every rank, so the ranks' plans still match.
        # ``costs_at``: the one count of micro-batches they order (the full batch's; None: every count).
        # A batch ramp-up's smaller steps run the default order, which holds no more than the full
        # batch's on any rank, where delays tuned at a smaller count could (``parallel.pipeline.ramp``).
        self.op_costs, self.costs_at = op_costs, costs_at
        # Called before each backward with whether it is the step's last on this rank: a gradient
        # reducer can then start communicating buckets as that backward completes them.
        self.before_backward = before_backward
        # A split-backward schedule's W ops hand each weight gradient to ``weight_grad_sink`` (the
        # data-parallel wrapper) to accumulate in place where it can (``deferred_wgrad``).
        self.wgrad: Optional[WeightGradQueue] = None
        if splits_backward(build_schedule(self.schedule, self.pp, self.rank, self.pp, self.v)):
            self.wgrad = WeightGradQueue(weight_grad_sink)
            if not defer_weight_grads(self.chunks, self.wgrad):
                raise ValueError(f"schedule {self.schedule} defers weight gradients of linear layers, "
                                 f"and pipeline rank {self.rank}'s chunks hold none")
        if (self.schedule == "zb-h2" and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"
                and self.device.type == "cuda"):
            # its plan relies on the two pipeline communicators' kernels running side by side, which one
            # hardware queue for all streams can order into a hang
            raise ValueError("parallel.pipeline_schedule zb-h2 needs its two pipeline communicators to run "
                             "side by side, and CUDA_DEVICE_MAX_CONNECTIONS=1 can serialize them into a hang: "
                             "unset it, or use zb-h1")
        groups = {"act": topo.pp_group, "grad": topo.pp_grad_group, "act_back": topo.group("pp_back"),
                  "grad_back": topo.group("pp_grad_back")}
        self.link = StageLink({c: groups[c] for c in channels(self.placement)}, topo.stage_rank,
                              tuple(activation_shape), dtype, self.device, timeout_s,
                              label=f"rank {topo.rank} (pipeline rank {self.rank})",
                              neighbours=neighbours(self.pp, self.rank, self.v, self.placement))
        self.stats = StepStats()
        self._events: list = []  # CUDA (start, end) events of profiled ops, summed at the end of a step
        # Whether the first step of each kind (training, evaluation) is rehearsed: see ``rehearse``;
        # a CPU test turns it on to check that a rehearsal leaves no trace.
        self.rehearses = self.device.type == "cuda" and self.pp > 1
        # the kinds rehearsed (by whether they keep a graph), each with whether its rehearsal ran
        # several micro-batches (see ``rehearsal_due``)
        self._rehearsed: dict[bool, bool] = {}

    @property
    def waiting_on(self) -> str:
        """What this rank is blocked on right now (``nothing`` between waits)."""
        return self.link.waiting_on

    def step(self, microbatches: Sequence[Any], grad_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward every micro-batch; returns the step's mean loss on every rank.

        Gradients are those of ``grad_scale`` times the mean loss over the micro-batches (a loss scaler
        passes its scale here). The returned loss is also averaged over the data-parallel group.
        """
        return self._run(self.schedule, microbatches, grad_scale / len(microbatches), keep_graph=True)

    def forward_only(self, microbatches: Sequence[Any]) -> torch.Tensor:
        """The mean loss of ``microbatches`` without backward (evaluation), on every rank.

        Runs under ``torch.no_grad`` and keeps nothing for a backward, so activations are freed as
        soon as they are sent; the loss is averaged as in ``step``.
        """
        with torch.no_grad():
            return self._run("forward_only", microbatches, 0.0, keep_graph=False)

    def rehearsal_due(self, micro_batches: int, keep_graph: bool = True) -> bool:
        """Whether the next step of this kind (training: ``keep_graph``; evaluation: not), of
        ``micro_batches``, should be rehearsed first (``rehearse``): on CUDA, before the first of each
        kind, and again before the first over several micro-batches after a rehearsal of one (a
        batch-size ramp-up): summing micro-batches runs kernels one does not (the weight gradients'
        ``addmm`` where one micro-batch's ``mm`` ran, the reducer's adds), and the reverse adds none."""
        if not self.rehearses:
            return False
        return keep_graph not in self._rehearsed or (micro_batches > 1 and not self._rehearsed[keep_graph])

    def rehearse(self, microbatches: Sequence[Any], keep_graph: bool = True) -> None:
        """Run this rank's ops of a step on ``microbatches`` with no pipeline transfer at all: zeros
        stand in for what neighbours would send, and what this rank would send is dropped.

        Why: the first step of a kind compiles and loads its kernels (Triton's, cuBLAS's), and on CUDA
        loading a kernel can wait for the device's running kernels to finish (NVIDIA's lazy-loading
        caveat), a posted point-to-point receive among them. Were the neighbour that must send that
        message loading a kernel of its own behind a receive from this rank, both would hang: ZB-V and
        ZB-H2 at pp 2 did on two H200s (BENCHMARKS.md). A rehearsal runs the step's own ops, so the
        same shapes and the same kernels, while no pipeline transfer is in flight; tensor- and
        data-parallel collectives still run inside it and meet their peers as ever, since no rank
        waits on a pipeline neighbour.

        Training (``keep_graph``) runs the schedule's ops, evaluation its forwards. For the real step to
        be what it would have been, the caller puts back the random streams the rehearsal's forwards
        drew from and drops the gradients it accumulated (``Engine._rehearse``).
        """
        schedule = self.schedule if keep_graph else "forward_only"
        m = len(microbatches)
        ops, plan = plan_for(schedule, self.pp, self.rank, m, self.v, self._costs_for(m), self.placement)
        run = _StepRun(self, microbatches, 1.0 / m, keep_graph, ops)
        with torch.set_grad_enabled(keep_graph):
            for step in plan:
                if step.op is None:
                    continue
                stand_in = None if step.needs is None else torch.zeros(self.link.shape, dtype=self.link.dtype,
                                                                       device=self.device)
                run.op(step.op, stand_in)
                run.outbox.clear()  # as the real step frees each once sent: kept, the step's messages add up
        self._rehearsed[keep_graph] = self._rehearsed.get(keep_graph, False) or len(microbatches) > 1

    def _costs_for(self, m: int) -> Optional[StageCosts]:
        """The op costs a step of ``m`` micro-batches is ordered by (``costs_at``)."""
        return self.op_costs if self.costs_at is None or m == self.costs_at else None

    def _run(self, schedule: str, microbatches: Sequence[Any], backward_scale: float, keep_graph: bool):
        self._sync()
        start = time.perf_counter()
        m = len(microbatches)
        ops, plan = plan_for(schedule, self.pp, self.rank, m, self.v, self._costs_for(m), self.placement)
        run = _StepRun(self, microbatches, backward_scale, keep_graph, ops)
        self.stats = StepStats()
        for k, step in enumerate(plan):
            sends = [(t, run.outbox.pop(t.message)) for t in step.sends]
            self.stats.sent += len(sends)
            self.link.exchange(sends, step.recvs, where=f"step {k} before {step.op}")
            self._release(self.link.finish_sends(block=False))
            if step.op is not None:
                # the op's input, waited for before its time starts: a profiled op excludes the wait
                received = None if step.needs is None else self.link.take(step.needs)
                self._timed(lambda op: run.op(op, received), step.op)
                self.stats.ops.append(step.op)
                self.stats.peak_held_bytes = max(self.stats.peak_held_bytes, run.held_bytes())
        self._release(self.link.finish_sends(block=True))
        if self.link.untaken or run.handed_over:
            raise RuntimeError(f"pipeline rank {self.rank}: received {self.link.untaken or sorted(run.handed_over)} "
                               f"but no op took them")
        if self.wgrad is not None and len(self.wgrad):
            raise RuntimeError(f"pipeline rank {self.rank}: weight gradients of {sorted(self.wgrad.pending)} "
                               f"(micro-batch, chunk) never ran: schedule {schedule} lacks their W ops")
        loss = self._step_loss(run.loss_sum, m)
        self._sync()
        self.stats.step_s = time.perf_counter() - start
        return loss

    def _release(self, sent: list[torch.Tensor]) -> None:
        for tensor in sent:
            free_storage(tensor)
        self.stats.released += len(sent)

    def _timed(self, fn: Callable[[Op], None], op: Op) -> None:
        """Run ``fn(op)``, adding its compute time to the stats when profiling.

        On CUDA the time comes from events on the compute stream, recorded after the exchange's
        stream waits, so it excludes time spent waiting for a neighbour and needs no host sync.
        """
        if not self.profile:
            return fn(op)
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            fn(op)
            self.stats.op_times.append((t0, time.perf_counter()))
            self.stats.compute_s += time.perf_counter() - t0
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(op)
        end.record()
        self._events.append((start, end))

    def _sync(self) -> None:
        """Wait for the step's GPU work when profiling, and turn its ops' events into times."""
        if self.profile and self.device.type == "cuda":
            done = torch.cuda.Event(enable_timing=True)
            done.record()
            torch.cuda.synchronize(self.device)
            now = time.time()  # the wall clock just after ``done``: anchors the events to it
            self.stats.compute_s += sum(s.elapsed_time(e) for s, e in self._events) / 1000
            if self._events:
                first = self._events[0][0]
                self.stats.op_times = [(first.elapsed_time(s) / 1000, first.elapsed_time(e) / 1000)
                                       for s, e in self._events]
                self.stats.first_op_at = now - first.elapsed_time(done) / 1000
            self._events = []
        elif self.stats.op_times:
            first = self.stats.op_times[0][0]
            self.stats.first_op_at = time.time() - (time.perf_counter() - first)
            self.stats.op_times = [(s - first, e - first) for s, e in self.stats.op_times]

    def _step_loss(self, loss_sum: Optional[torch.Tensor], m: int) -> torch.Tensor:
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.rank == self.loss_rank:
            loss += loss_sum / m
            if self.topo.dp_size > 1:
                dist.all_reduce(loss, group=self.topo.dp_group)
                loss /= self.topo.dp_size
        return broadcast_from_last_stage(loss, self.topo.pp_group, self.topo.stage_rank(self.loss_rank))


class _StepRun:
    """The tensors of one step in flight: outputs kept for backward, messages to send (received inputs
    wait in the link until their op takes them), and messages between two chunks of this rank (a V's
    turn), handed over in memory."""

    def __init__(self, executor: PipelineExecutor, microbatches: Sequence[Any], backward_scale: float,
                 keep_graph: bool, ops: Sequence[Op]):
        self.ex, self.microbatches, self.backward_scale = executor, microbatches, backward_scale
        self.keep_graph = keep_graph
        self.last_stage = executor.pp * executor.v - 1
        self.outbox: dict[Message, torch.Tensor] = {}
        self.handed_over: dict[Message, torch.Tensor] = {}
        self.saved: dict[tuple[int, int], tuple[Optional[torch.Tensor], torch.Tensor]] = {}
        self.loss_sum: Optional[torch.Tensor] = None
        # the backwards of the step's ``ops`` run so far, and in all: the last one lets a reducer start
        self.backward_ops_done, self.backward_total = 0, sum(op.kind == "B" for op in ops)
        self.awaiting_w: set[tuple[int, int]] = set()  # backward ran, deferred weight gradients not yet

    def op(self, op: Op, received: Optional[torch.Tensor]) -> None:
        """Run ``op`` with ``received``, its input from a neighbour (None where it takes none)."""
        {"F": self.forward, "B": self.backward, "W": self.weight_grads}[op.kind](op, received)

    def _stage(self, op: Op) -> int:
        return stage_of(self.ex.pp, self.ex.rank, op.chunk, self.ex.placement)

    def _message(self, kind: str, microbatch: int, stage: int) -> Message:
        return boundary_message(kind, microbatch, stage, self.ex.pp, self.ex.placement)

    def _here(self, stage: int) -> bool:
        """Whether virtual stage ``stage`` runs on this rank too."""
        return holder_of(self.ex.pp, stage, self.ex.placement)[0] == self.ex.rank

    def held_bytes(self) -> int:
        return sum(out.untyped_storage().nbytes() for _, out in self.saved.values())

    def forward(self, op: Op, received: Optional[torch.Tensor]) -> None:
        """``received``: the previous stage's activation (None on the first stage, or held here)."""
        s = self._stage(op)
        if s > 0 and self._here(s - 1):  # the previous chunk's output, cut off its graph: B runs per chunk
            received = self.handed_over.pop(Message("act", op.microbatch, s - 1)).detach()
        x = None if s == 0 else received.requires_grad_(self.keep_graph)
        out = self.ex.forward_step(self.ex.chunks[op.chunk], x, self.microbatches[op.microbatch],
                                   s == 0, s == self.last_stage)
        if s == self.last_stage:
            if out.numel() != 1:
                raise ValueError(f"the last pipeline stage must return a scalar loss, got shape {tuple(out.shape)}")
            detached = out.detach().float().reshape(())
            self.loss_sum = detached if self.loss_sum is None else self.loss_sum + detached
        elif self._here(s + 1):
            self.handed_over[Message("act", op.microbatch, s)] = out
        else:
            # a contiguous send buffer that no autograd node saved, so its storage can go once sent
            out = out.clone(memory_format=torch.contiguous_format)
            self.outbox[self._message("act", op.microbatch, s)] = out
        if self.keep_graph:
            self.saved[(op.microbatch, op.chunk)] = (x, out)
            self.ex.stats.peak_live = max(self.ex.stats.peak_live, len(self.saved) + len(self.awaiting_w))

    def backward(self, op: Op, received: Optional[torch.Tensor]) -> None:
        """``received``: the next stage's gradient (None on the last stage)."""
        if self.ex.before_backward is not None:
            self.ex.before_backward(op, self.backward_ops_done == self.backward_total - 1)
        self.backward_ops_done += 1
        s = self._stage(op)
        x, out = self.saved.pop((op.microbatch, op.chunk))
        if s == self.last_stage:
            grad = torch.full_like(out, self.backward_scale)
        elif self._here(s + 1):
            grad = self.handed_over.pop(Message("grad", op.microbatch, s + 1))
        else:
            grad = received
        if self.ex.wgrad is None:
            torch.autograd.backward(out, grad)
        else:
            with self.ex.wgrad.backward_of((op.microbatch, op.chunk)):
                torch.autograd.backward(out, grad)
            self.awaiting_w.add((op.microbatch, op.chunk))
        if s > 0:
            if x.grad is None:
                raise ValueError(f"virtual stage {s} did not use its input: its output does not depend on "
                                 f"the activation it received")
            if self._here(s - 1):
                self.handed_over[Message("grad", op.microbatch, s)] = x.grad
            else:
                self.outbox[self._message("grad", op.microbatch, s)] = x.grad.contiguous()

    def weight_grads(self, op: Op, _received: Optional[torch.Tensor] = None) -> None:
        """The deferred weight gradients of ``op``'s micro-batch; after the last ``B``, of every one left."""
        if self.backward_ops_done < self.backward_total:
            keys = [(op.microbatch, op.chunk)]
        else:  # the tail: one sum per weight, so each parameter gets one gradient after the last B
            keys = sorted(self.awaiting_w)
        ran, in_place = self.ex.wgrad.run(keys)
        if keys and not ran:  # every chunk holds linears (checked at construction): their B must have queued some
            raise RuntimeError(f"pipeline rank {self.ex.rank}: {op} found no weight gradients queued by its B: "
                               f"the linears computed them in backward (a compiled graph that traced them "
                               f"without deferral?) or have none (all frozen), so the schedule's split "
                               f"backward is not happening; use 1f1b")
        self.ex.stats.deferred += ran
        self.ex.stats.deferred_in_place += in_place
        self.awaiting_w.difference_update(keys)
