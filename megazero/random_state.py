"""The random streams one rank's training draws from, captured and put back as one value.

A rank draws from the host generator, the current CUDA device's, and each model chunk's
tensor-parallel stream (``parallel.tensor_parallel.random``; dropout on sharded activations). A
checkpoint stores them so that a resumed run with dropout repeats the masks it would have drawn; a
pipeline's first-step rehearsal restores them so that its forwards leave the real step's masks alone.
"""

from __future__ import annotations

import torch


def rng_state(chunks) -> dict:
    """This rank's random streams now: the host's, the CUDA device's (where there is one), and each
    of ``chunks``' tensor-parallel streams (None for a chunk without one)."""
    state = {"cpu": torch.get_rng_state(), "tp": [getattr(c, "tp_rng", None) and c.tp_rng.state for c in chunks]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(chunks, state: dict) -> None:
    """Put back what ``rng_state`` captured."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    for chunk, tp_state in zip(chunks, state["tp"]):
        if tp_state is not None and getattr(chunk, "tp_rng", None) is not None:
            chunk.tp_rng.state = tp_state
