"""Point-to-point exchange between pipeline neighbours: one batched isend/irecv per plan step and channel.

Every message between stages has the same shape (the activation at a stage boundary, sequence-
sharded under sequence parallelism, and its gradient), known before the step starts, so receive
buffers are allocated without asking the sender: no shape exchange at all.

Each rank remembers what it is waiting for; on gloo a receive that does not arrive within the
timeout raises ``PipelineTimeout`` naming the rank, the step and the message, instead of hanging
silently. On NCCL waits do not block the CPU (they order GPU streams), so a hang is reported by
the process group's watchdog after its own timeout.
"""

from __future__ import annotations

import datetime
from typing import Sequence

import torch
import torch.distributed as dist

from parallel.pipeline.plan import BACK_CHANNELS, CHANNELS, Message, Transfer, channel_of


class PipelineTimeout(RuntimeError):
    """A pipeline receive did not complete in time: a peer died, hangs, or runs a different schedule."""


class StageLink:
    """Sends and receives one pipeline rank's boundary tensors along its pipeline groups.

    ``groups`` maps each channel of ``plan.CHANNELS`` (activations, gradients), and for a V-shaped
    pipeline ``plan.BACK_CHANNELS`` too, to the process group carrying it: communicators over the same
    ranks, so that on NCCL, whose operations on one communicator complete in order, a send waiting
    for its receiver holds up only later messages of its own channel. ``peer_rank(pp_rank)`` maps a
    pipeline rank to its global rank (``Topology.stage_rank``); ``neighbours`` are the pipeline ranks
    this one exchanges with.
    """

    def __init__(self, groups: dict[str, dist.ProcessGroup], peer_rank, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, timeout_s: float = 300.0, label: str = "", neighbours: Sequence[int] = ()):
        if set(groups) not in (set(CHANNELS), set(CHANNELS + BACK_CHANNELS)):
            raise ValueError(f"a pipeline link needs one group per channel {CHANNELS} (and {BACK_CHANNELS} for a "
                             f"V-shaped pipeline), got {sorted(groups)}")
        self.groups, self.peer_rank = groups, peer_rank
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.label = label
        self.waiting_on = "nothing"
        self._in_flight: list[tuple[dist.Work, torch.Tensor]] = []  # sends and the work that carries each
        # posted receives not yet taken: message -> (buffer, works delivering it, what they are)
        self._arriving: dict[Message, tuple[torch.Tensor, list, str]] = {}
        # NCCL waits only order the GPU streams; a wait with a timeout would block the CPU at every
        # exchange instead, so there the process group's own watchdog reports a hang.
        group = groups[CHANNELS[0]]
        self._nccl = dist.get_world_size(group) > 1 and dist.get_backend(group) == "nccl"
        if self._nccl:
            # NCCL wants every rank of a group in its first call; later batches may involve only neighbours
            for group in groups.values():
                dist.all_reduce(torch.zeros(1, device=device), group=group)
            self._connect(neighbours)

    def _connect(self, neighbours) -> None:
        """One tiny exchange with each neighbour on every channel, both ways, before any step.

        Why: NCCL connects two ranks for point-to-point at their first send or receive on a
        communicator, and that set-up blocks the host until the peer's host makes its own first call
        there. Inside a step the peer's host can be busy for long (compiling, or loading a compiled
        kernel, which can wait for the GPU's running communication kernels to finish), and a ZB-V
        order at pp 2 hung so on two H200s (BENCHMARKS.md)."""
        for channel, group in self.groups.items():
            ops = []
            for peer in neighbours:
                ops += [dist.P2POp(dist.isend, torch.zeros(1, device=self.device), self.peer_rank(peer), group),
                        dist.P2POp(dist.irecv, torch.empty(1, device=self.device), self.peer_rank(peer), group)]
            if ops:
                for work in dist.batch_isend_irecv(ops):
                    self._wait([work], f"connecting pipeline channel {channel}")

    def exchange(self, sends: list[tuple[Transfer, torch.Tensor]], recvs: tuple[Transfer, ...], where: str) -> None:
        """Post ``sends`` and ``recvs`` as one batch per channel; ``take`` each received message when its
        op needs it.

        Nothing is waited for here. Sends are not waited for at all (their buffers stay referenced until
        they complete, see ``finish_sends``), so a rank never blocks on a neighbour that is itself busy
        sending; a receive is waited for only by the op that consumes it (on NCCL, with its channel's
        whole batch), so the forward of an interleaved pair does not wait for the gradient its
        backward will take. Every channel's batch is posted before any is waited on: a receive may
        depend on a send of the other channel reaching its peer first.
        """
        for transfer, tensor in sends:
            if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
                raise ValueError(f"pipeline boundary tensor {transfer.message} is {tuple(tensor.shape)} "
                                 f"{tensor.dtype}, but the pipeline was set up for {self.shape} {self.dtype}: "
                                 f"pass the activation shape each stage really outputs")
        buffers = {tr.message: torch.empty(self.shape, dtype=self.dtype, device=self.device) for tr in recvs}
        for channel in self.groups:
            mine = [(tr, t) for tr, t in sends if channel_of(tr.message) == channel]
            wanted = [tr for tr in recvs if channel_of(tr.message) == channel]
            for message, works, what in self._post(self.groups[channel], mine, wanted, buffers, where):
                self._arriving[message] = (buffers[message], works, what)

    def take(self, message: Message) -> torch.Tensor:
        """The received ``message``, once it has landed (an earlier ``exchange`` posted its receive)."""
        if message not in self._arriving:
            raise RuntimeError(f"{self.label}: {message} was never posted for receipt; the plan and the ops "
                               f"it runs disagree")
        buffer, works, what = self._arriving.pop(message)
        self._wait(works, what)
        return buffer

    def _post(self, group, sends: list[tuple[Transfer, torch.Tensor]], recvs: list[Transfer],
              buffers: dict[Message, torch.Tensor], where: str) -> list[tuple[Message, list, str]]:
        """Post one channel's batch; returns, for each receive, (message, works to wait on, description)."""
        ops = [dist.P2POp(dist.isend, t, self.peer_rank(tr.peer), group) for tr, t in sends]
        ops += [dist.P2POp(dist.irecv, buffers[tr.message], self.peer_rank(tr.peer), group) for tr in recvs]
        if not ops:
            return []
        works = dist.batch_isend_irecv(ops)
        if not recvs:  # nothing to wait for before the next op (a W after its B): sends stay in flight
            self._in_flight += [(works[min(i, len(works) - 1)], t) for i, (_, t) in enumerate(sends)]
            return []
        if len(works) != len(ops):  # coalesced into one handle (NCCL): the batch completes as a whole
            # a send's buffer is released only once the batch has completed: its receives are waited
            # for later, by the op that takes them, and the storage must outlive the send until then
            self._in_flight += [(works[0], t) for _, t in sends]
            return [(tr.message, works, f"{where}: batch " + _describe(sends, recvs)) for tr in recvs]
        self._in_flight += [(w, t) for w, (_, t) in zip(works, sends)]
        return [(tr.message, [work], f"{where}: recv {tr.message} from pipeline rank {tr.peer}")
                for work, tr in zip(works[len(sends):], recvs)]

    @property
    def untaken(self) -> list[Message]:
        """Messages received (or still arriving) that no op has taken."""
        return sorted(self._arriving, key=repr)

    def finish_sends(self, block: bool) -> list[torch.Tensor]:
        """Tensors whose sends have completed (all of them, waiting, when ``block``)."""
        done, still = [], []
        for work, tensor in self._in_flight:
            if block:
                self._wait([work], "end of step: sends still in flight")
            if block or work.is_completed():
                done.append(tensor)
            else:
                still.append((work, tensor))
        self._in_flight = still
        return done

    def _wait(self, works: list, what: str) -> None:
        self.waiting_on = what
        try:
            for work in works:
                if self._nccl:
                    work.wait()
                else:
                    work.wait(self.timeout)
        except RuntimeError as err:
            raise PipelineTimeout(f"{self.label} gave up after {self.timeout.total_seconds():.0f}s waiting on "
                                  f"{what}: {err}") from err
        self.waiting_on = "nothing"


def _describe(sends, recvs) -> str:
    parts = [f"send {tr.message} to pipeline rank {tr.peer}" for tr, _ in sends]
    return ", ".join(parts + [f"recv {tr.message} from pipeline rank {tr.peer}" for tr in recvs])


def free_storage(tensor: torch.Tensor) -> None:
    """Drop ``tensor``'s memory but keep its shape, so autograd can still start backward from it.

    Only valid on a tensor no autograd node saved (the executor sends a fresh clone for that reason):
    its storage becomes one element broadcast to the old shape.
    """
    tensor.data = torch.empty(1, dtype=tensor.dtype, device=tensor.device).expand(tensor.shape)


def broadcast_from_last_stage(value: torch.Tensor, group, src: int) -> torch.Tensor:
    """Every pipeline rank gets the last stage's ``value`` (for logging the loss everywhere)."""
    if dist.get_world_size(group) > 1:
        dist.broadcast(value, src=src, group=group)
    return value

