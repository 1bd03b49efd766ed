"""One-token decode steps replayed from a CUDA graph.

A drawn token's forward is a few hundred small kernels; on a GPU their launches, not their work,
set the pace (a 1.3B Llama read one token in about 16 ms, of which the weights' reads are well under
one). Captured once, the step replays as one launch. Its inputs are fixed buffers: the token id,
and the cache's position as a device scalar (``KVCache.position``), so the graph's positions,
rotary rows, key writes and causal mask follow each replay's position.
"""

from __future__ import annotations

import torch

from models.kv_cache import KVCache

WARM_UP_STEPS = 2
"""Eager steps before the capture, on a side stream: kernels are compiled and tuned (Triton's
autotuning runs then), and the allocator settles, so nothing of that is captured."""


class DecodeGraph:
    """``model.decode`` of one token per row after what ``cache`` holds, captured as a CUDA graph.

    Build it once the prompt is in the cache, and call it with each step's ids [batch, 1]; it
    returns the logits of the last position (a buffer each replay overwrites). The warm-up and the
    capture write keys and values at the cache's next position, which the first replay overwrites
    before any query reads it.
    """

    def __init__(self, model: torch.nn.Module, cache: KVCache, batch: int, device: torch.device):
        self.model, self.cache = model, cache
        self.ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
        cache.position = torch.full((), cache.length, dtype=torch.long, device=device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(WARM_UP_STEPS):
                self._step()
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step()

    def _step(self) -> torch.Tensor:
        """One warm-up or captured step, at the position the next replay reads; ``decode`` counts the
        position as read, which no token was: the count is taken back."""
        logits = self.model.decode(self.ids, self.cache)
        self.cache.length -= 1
        return logits

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """The logits after ``ids`` [batch, 1], read at the cache's next position."""
        self.cache.check_room(1)
        self.ids.copy_(ids)
        self.cache.position.fill_(self.cache.length)
        self.graph.replay()
        self.cache.advance(1)
        return self.logits
