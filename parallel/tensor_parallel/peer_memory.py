"""Tensor-group collectives through peer memory, moved by the GPUs' copy engines.

NCCL's collectives are kernels: while an overlapped linear's matrix product holds every streaming
multiprocessor, NCCL's blocks wait for room and then compete with it, so a collective that takes
about 100 µs alone takes 240-300 µs beside a GEMM and the GEMM slows too. Inside one node the
ranks of a tensor group can instead read and write each other's memory directly: each process maps
its peers' halves of a symmetric workspace (``torch.distributed._symmetric_memory``), and a
``copy_`` between a local tensor and a peer's buffer is a device-to-device memcpy that the copy
engines carry over NVLink, using no multiprocessor. Only the barriers (one block each) and the final
sum of a reduce-scatter (a short memory-bound kernel) run on multiprocessors.

All work runs on one side stream per device, in the order it was issued, and each operation has
the same shape on every rank of the group: writes, a barrier, reads, a barrier. The closing barrier
means that when any rank starts its next operation's writes, every rank has finished reading the
last one's, so a single workspace per group serves every operation in turn. The caller receives a
handle whose ``wait()`` makes its current stream wait for the side stream. Every tensor the side
stream touches is allocated on the caller's stream; the handle holds the inputs it reads until that
wait, and the caller must wait before it uses or drops an output (every caller in ``overlap`` waits
inside the same operator), so the caching allocator never hands memory to other work while a copy
is still in flight. A barrier gives up after the timeout its group was reserved with (``reserve``;
``BARRIER_TIMEOUT_MS`` for a group never reserved) when a peer died, as NCCL's watchdog would,
instead of spinning for ever.

Token chunks follow ``collectives``: rank ``r`` owns rows ``[r * n, (r + 1) * n)``. Each rank's
slot in a workspace sits at offset ``r * n`` elements, whichever operation uses it.
"""

from __future__ import annotations

import functools
import warnings

import torch

_WORKSPACE_CHANNEL = 0
BARRIER_TIMEOUT_MS = 600_000
"""How long a barrier of a group that ``reserve`` never set up waits for its peers."""
_barrier_timeouts_ms: dict[str, int] = {}


def available() -> bool:
    """Whether this torch build maps peer memory for process groups (CUDA builds with symmetric memory)."""
    if not torch.cuda.is_available():
        return False
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return True


def reaches_peers(device: torch.device) -> bool:
    """Whether ``device`` can map the memory of every other GPU this process sees (NVLink, or PCIe
    peer access): symmetric memory needs it, and PCIe boxes without peer access, some consumer GPUs
    and virtual machines with it turned off lack it."""
    if device.type != "cuda" or not available():
        return False
    here = device.index if device.index is not None else torch.cuda.current_device()
    return all(torch.cuda.can_device_access_peer(here, other) for other in range(torch.cuda.device_count())
               if other != here)


@functools.cache
def _side_stream(device: int) -> torch.cuda.Stream:
    # high priority: its barriers and sums are short and others wait on them
    return torch.cuda.Stream(device=device, priority=-1)


@functools.cache
def _register(group_name: str) -> None:
    """Older torch needs each group announced to symmetric memory once; newer torch warns that the
    call is no longer needed, which is harmless."""
    from torch.distributed import _symmetric_memory as symm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        symm.enable_symm_mem_for_group(group_name)


def _workspace(group_name: str, nbytes: int):
    """The group's symmetric workspace, at least ``nbytes`` on each rank. Growing it is a collective
    rendezvous; every rank asks for the same sizes in the same order, as they run the same ops."""
    from torch.distributed import _symmetric_memory as symm

    _register(group_name)
    return symm.get_symm_mem_workspace(group_name, min_size=nbytes)


def reserve(group_name: str, nbytes: int, barrier_timeout_s: float) -> None:
    """Grow the group's workspace to ``nbytes`` now, before any block is compiled or recorded, and set
    how long its barriers wait for a peer. Blocks replayed as CUDA graphs run their first call
    eagerly with every allocation routed into the graphs' memory pool; a workspace first grown there
    stays alive in that pool, untracked, and torch refuses to record the graph (and growing it
    during a capture is refused outright). The timeout is read when an operation is issued (or
    recorded into a graph), so it is set here, first. Collective: every rank of the group calls it
    with the same size."""
    if barrier_timeout_s <= 0:
        raise ValueError(f"peer-memory barrier timeout must be positive, got {barrier_timeout_s} s")
    _barrier_timeouts_ms[group_name] = int(barrier_timeout_s * 1000)
    _workspace(group_name, nbytes)


def barrier_timeout_ms(group_name: str) -> int:
    """How long the group's barriers wait for a peer before they fail."""
    return _barrier_timeouts_ms.get(group_name, BARRIER_TIMEOUT_MS)


class _SideStreamWork:
    """What an asynchronous collective returns: ``wait()`` orders the caller's stream after it.

    It holds the tensors the side stream reads until then: a temporary freed by the caller could
    otherwise be handed to new work on the caller's stream while a copy still reads it."""

    def __init__(self, stream: torch.cuda.Stream, reads: tuple[torch.Tensor, ...]):
        self.event = torch.cuda.Event()
        self.event.record(stream)
        self._reads = reads

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)
        self._reads = ()


def _enter_side_stream() -> torch.cuda.Stream:
    stream = _side_stream(torch.cuda.current_device())
    stream.wait_stream(torch.cuda.current_stream())  # inputs are ready, outputs allocated
    return stream


def all_gather(full: torch.Tensor, rows: torch.Tensor, group_name: str) -> _SideStreamWork:
    """Start gathering every rank's ``rows`` [n, h] into ``full`` [size * n, h], rank r's at chunk r:
    each rank stages its rows in its own slot, then pulls its peers' slots.

    The caller's stream is left waiting for the staging: the work it queues next (the product of
    its own rows, in ``overlap``) starts once every rank's rows are ready to pull. The staging copy
    and the barrier are kernels; queued beside a matrix product that holds every multiprocessor
    they would wait for it to finish, and the pulls with them, which serialised the gather after
    the product it was meant to run beside. Behind them, only the copy engines' pulls run beside
    the product. The returned work ends with this rank's pulls; the closing barrier, which only
    guards the workspace, follows on the side stream, where the next operation's work covers it.
    Inside a CUDA-graph capture the work ends with the closing barrier instead: a capture must end
    with every stream it forked joined back, and the gather may be the last operation recorded."""
    n = rows.shape[0]
    size = full.shape[0] // n
    ws = _workspace(group_name, full.numel() * full.element_size())
    rank, timeout_ms = ws.rank, barrier_timeout_ms(group_name)
    capturing = torch.cuda.is_current_stream_capturing()
    stream = _enter_side_stream()
    with torch.cuda.stream(stream):
        ws.get_buffer(rank, rows.shape, rows.dtype, rank * rows.numel()).copy_(rows)
        full[rank * n:(rank + 1) * n].copy_(rows)
        ws.barrier(channel=_WORKSPACE_CHANNEL, timeout_ms=timeout_ms)
        staged = torch.cuda.Event()
        staged.record(stream)
        for step in range(1, size):
            peer = (rank + step) % size
            full[peer * n:(peer + 1) * n].copy_(ws.get_buffer(peer, rows.shape, rows.dtype, peer * rows.numel()))
        if not capturing:
            work = _SideStreamWork(stream, (rows,))
        ws.barrier(channel=_WORKSPACE_CHANNEL, timeout_ms=timeout_ms)
        if capturing:
            work = _SideStreamWork(stream, (rows,))
    torch.cuda.current_stream().wait_event(staged)
    return work


class ChunkSum:
    """A reduce-scatter built one token chunk at a time: ``push`` sends this rank's partial values of
    an owner's chunk into the owner's workspace slot as soon as they exist (while the next chunk is
    still being computed), and ``finish`` adds the pushed partials to this rank's own.

    Every rank must push to every other owner once, then finish, in any order."""

    def __init__(self, chunk_shape: torch.Size, dtype: torch.dtype, group_name: str, size: int):
        numel = chunk_shape.numel()
        self.shape, self.dtype, self.size = chunk_shape, dtype, size
        self.ws = _workspace(group_name, size * numel * dtype.itemsize)
        self.rank, self.timeout_ms = self.ws.rank, barrier_timeout_ms(group_name)
        self._reads: list[torch.Tensor] = []

    def _slot(self, owner: int, source: int) -> torch.Tensor:
        return self.ws.get_buffer(owner, self.shape, self.dtype, source * self.shape.numel())

    def push(self, part: torch.Tensor, owner: int) -> None:
        with torch.cuda.stream(_enter_side_stream()):
            self._slot(owner, self.rank).copy_(part)
        self._reads.append(part)

    def finish(self, own: torch.Tensor) -> tuple[torch.Tensor, _SideStreamWork]:
        """(the sum of every rank's partial of this rank's chunk, the work to wait on before reading it)."""
        total = torch.empty(self.shape, dtype=self.dtype, device=own.device)  # on the caller's stream
        stream = _enter_side_stream()
        with torch.cuda.stream(stream):
            self._slot(self.rank, self.rank).copy_(own)
            self.ws.barrier(channel=_WORKSPACE_CHANNEL, timeout_ms=self.timeout_ms)
            torch.sum(self.ws.get_buffer(self.rank, (self.size, *self.shape), self.dtype, 0), 0, out=total)
            self.ws.barrier(channel=_WORKSPACE_CHANNEL, timeout_ms=self.timeout_ms)
            return total, _SideStreamWork(stream, (*self._reads, own))
