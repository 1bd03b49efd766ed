"""Flat buffers whose memory comes and goes while the tensor (and every view of it) stays.

Stage 3's gathered parameters and stages 0-1's gradient buffers hold memory only part of a step.
Resizing the untyped storage to zero gives the bytes back to the allocator without touching the
tensor objects that autograd, the optimizer or a module hold; resizing it back makes those same
views valid again (over new, uninitialised memory). Reading a view while its storage is released
is undefined: ``holds_storage`` says whether a buffer has its memory now.
"""

from __future__ import annotations

import torch


def take_storage(buf: torch.Tensor) -> None:
    """Give ``buf`` (a whole buffer, not a view into one) memory again; its contents are undefined."""
    buf.untyped_storage().resize_(buf.numel() * buf.element_size())


def release_storage(buf: torch.Tensor) -> None:
    """Give ``buf``'s memory back to the allocator; ``buf`` and its views stay attached to the empty storage."""
    buf.untyped_storage().resize_(0)


def holds_storage(buf: torch.Tensor) -> bool:
    """Whether ``buf`` has memory now (taken, not released)."""
    return buf.untyped_storage().nbytes() > 0


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (views counted once, released ones as zero)."""
    storages = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            storages[storage.data_ptr(), storage.nbytes()] = storage.nbytes()
    return sum(storages.values())
