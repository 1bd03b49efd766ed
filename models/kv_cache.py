"""Keys and values of the tokens a model has read, kept so the next token's forward reads that token alone.

Without a cache each drawn token re-ran the whole context through the model: a 1.3B model continuing
a 500-token prompt on a CPU does about 500 times the work a token needs. Only the single-device
model decodes (``megazero generate``); training never builds one.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

Start = Union[int, torch.Tensor]
"""Where a forward's tokens begin: a host int, or a device scalar while the forward runs inside a CUDA
graph (whose replays each decode at another position, which a host int would have baked in)."""


def positions(start: Start, count: int, device) -> torch.Tensor:
    """Positions ``start .. start + count - 1`` on ``device``."""
    if isinstance(start, int):
        return torch.arange(start, start + count, device=device)
    return start + torch.arange(count, device=device)


class KVCache:
    """Every attention layer's keys and values (rotary applied) for positions ``0 .. length - 1``.

    Positions are absolute, so the cache holds at most ``capacity`` tokens: no more than the model's
    ``seq_length`` (its learned positions and rotary tables end there), and no more than decoding will
    read (a context of 131072 tokens is gigabytes of keys a layer). A layer's buffers are made at its
    first ``extend``, in that call's batch, dtype and device.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.length = 0
        self.position: Optional[torch.Tensor] = None  # set for a CUDA graph's forwards: see ``start``
        self._layers: dict[str, LayerCache] = {}

    @property
    def start(self) -> Start:
        """The position of the first token of the forward in progress: ``length``, or, once
        ``position`` is set, that device scalar (its owner keeps it equal to ``length``)."""
        return self.length if self.position is None else self.position

    def layer(self, name: str) -> LayerCache:
        """The cache of the layer named ``name`` (a block's name in the model)."""
        if name not in self._layers:
            self._layers[name] = LayerCache(self)
        return self._layers[name]

    def check_room(self, tokens: int) -> None:
        """Refuse ``tokens`` more positions where they do not fit, before any layer is written."""
        if self.length + tokens > self.capacity:
            raise ValueError(f"a KV cache of {self.capacity} positions cannot take positions "
                             f"{self.length}..{self.length + tokens - 1}")

    def advance(self, tokens: int) -> None:
        """Count ``tokens`` more positions as read: every layer has extended by them."""
        self.length += tokens


class LayerCache:
    """One layer's part of a ``KVCache``: its keys and values, written where the cache's length says."""

    def __init__(self, owner: KVCache):
        self.owner = owner
        self.keys: Optional[torch.Tensor] = None  # [batch, kv_heads, capacity, head_dim]
        self.values: Optional[torch.Tensor] = None

    @property
    def start(self) -> Start:
        """The position of the first token of the forward in progress."""
        return self.owner.start

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' ``k`` and ``v`` ([batch, kv_heads, seq, head_dim]) after the ones read
        before, and return the keys and values of every position read, these included. At a device
        ``start`` they are every position the cache can hold (shapes a graph can replay), those past
        the new tokens unwritten or stale: the causal mask from ``start`` hides them."""
        if self.keys is None:  # zeros: a masked key's weight is 0, but 0 x NaN (unwritten memory) is NaN
            shape = (k.shape[0], k.shape[1], self.owner.capacity, k.shape[3])
            self.keys = k.new_zeros(shape)
            self.values = v.new_zeros(shape)
        start = self.start
        if not isinstance(start, int):
            at = positions(start, k.shape[2], k.device)
            self.keys.index_copy_(2, at, k)
            self.values.index_copy_(2, at, v)
            return self.keys, self.values
        end = start + k.shape[2]
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]
