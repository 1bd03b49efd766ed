"""A second random stream for dropout inside tensor-parallel regions.

Dropout on a *replicated* activation (the residual stream without sequence parallelism) must draw
the same mask on every tp rank, or the ranks' copies drift apart: that uses the default generator,
which the caller seeds identically on all tp ranks. Dropout on a *sharded* activation (this rank's
attention heads, or its token chunk under sequence parallelism) must draw different masks per
rank, or the full-model mask would repeat itself tp times: that runs inside ``rng.fork()``, which
swaps in a stream seeded with ``seed + offset + tp_rank`` and swaps the default back afterwards.

Activation checkpointing re-runs a forward in backward; ``checkpoint_contexts`` makes the re-run
see the tp stream exactly as the first run did (the default stream is restored by
``torch.utils.checkpoint`` itself), so dropout masks are reproduced.
"""

from __future__ import annotations

import contextlib

import torch

TP_SEED_OFFSET = 2718


class TensorParallelRNG:
    def __init__(self, seed: int, tp_rank: int, device="cpu"):
        self.device = torch.device(device)
        generator = torch.Generator(self.device)
        generator.manual_seed(seed + TP_SEED_OFFSET + tp_rank)
        self.state = generator.get_state()

    def _get(self) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.get_rng_state()
        return torch.get_device_module(self.device.type).get_rng_state(self.device)

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cpu":
            torch.set_rng_state(state)
        else:
            torch.get_device_module(self.device.type).set_rng_state(state, self.device)

    @contextlib.contextmanager
    def fork(self):
        """Run the block with the tp stream as the device's default generator."""
        outer = self._get()
        self._set(self.state)
        try:
            yield
        finally:
            self.state = self._get()
            self._set(outer)

    def checkpoint_contexts(self):
        """``context_fn`` for ``torch.utils.checkpoint``: remember the tp stream now, replay it on recompute."""
        snapshot = self.state.clone()

        @contextlib.contextmanager
        def recompute():
            current = self.state
            self.state = snapshot
            try:
                yield
            finally:
                self.state = current

        return contextlib.nullcontext(), recompute()
