"""Copies between the GPU and an offloaded (host) optimizer, on a stream of their own.

ZeRO-Offload moves every reduced gradient to the host and every updated parameter back, each
step: on the compute stream those transfers would stall the GPU for their whole length. Here a
gradient bucket leaves as soon as its last reduction is done, while backward still runs, and a
unit's updated parameters go back (and, under ZeRO, are gathered) on this stream too, so the
compute stream waits only when it reaches a unit whose upload is not done. On a CPU-only run the
copies are plain and immediate.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch


class HostCopies:
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after_compute: bool = True) -> None:
        """``dst.copy_(src)`` on the copy stream; with ``after_compute`` only after the work queued so
        far on the current stream (which may still be writing ``src``). Host memory must be pinned
        to run asynchronously."""
        if self.stream is None:
            dst.copy_(src)
            return
        if after_compute:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    @contextlib.contextmanager
    def on_stream(self, after_compute: bool):
        """Issue work (e.g. a collective, which then also waits for the copies) on the copy stream;
        with ``after_compute`` only after what the current stream queued so far, which may still use
        memory this work writes (such as a block the caching allocator just handed out again)."""
        if self.stream is None:
            yield
            return
        if after_compute:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def record(self) -> Optional[torch.cuda.Event]:
        """An event marking the end of everything issued on the copy stream so far (None on CPU)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def synchronize(self) -> None:
        """Wait on the host until every copy issued so far is done."""
        if self.stream is not None:
            self.stream.synchronize()


def wait_on_current_stream(event: Optional[torch.cuda.Event]) -> None:
    """Make the current stream's later work wait for ``event``, without blocking the host."""
    if event is not None:
        torch.cuda.current_stream().wait_event(event)
