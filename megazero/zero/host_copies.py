"""Copies between the GPU and an offloaded (host) optimizer, on a stream of their own.

ZeRO-Offload moves every reduced gradient to the host and every updated parameter back, each
step: on the compute stream those transfers would stall the GPU for their whole length. Here a
gradient bucket leaves as soon as its last reduction is done, while backward still runs, and a
unit's updated parameters come back in the order the next forward needs them, each unit waiting
only for its own. On a CPU-only run the copies are plain and immediate.
"""

from __future__ import annotations

from typing import Optional

import torch


class HostCopies:
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Optional[torch.cuda.Event]:
        """``dst.copy_(src)`` after the work queued so far on the current stream; returns the event
        that marks its end (None when immediate). Host memory must be pinned to run asynchronously."""
        if self.stream is None:
            dst.copy_(src)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return event

    def synchronize(self) -> None:
        """Wait on the host until every copy issued so far is done."""
        if self.stream is not None:
            self.stream.synchronize()


def wait_on_current_stream(event: Optional[torch.cuda.Event]) -> None:
    """Make the current stream's later work wait for ``event`` (a copy's end), without blocking the host."""
    if event is not None:
        torch.cuda.current_stream().wait_event(event)
