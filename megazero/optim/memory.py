"""The ZeRO memory model: model-state bytes per device for a stage, and the start-up report.

With Ψ parameters, Nd data-parallel ranks, p/g bytes per parameter and gradient element and K
bytes of optimizer state per parameter (fp32 master + two Adam moments: K = 12), the ZeRO paper's
per-device model states are (p + g + K)Ψ for plain data parallelism, (p + g)Ψ + KΨ/Nd for stage 1,
pΨ + (g + K)Ψ/Nd for stage 2 and (p + g + K)Ψ/Nd for stage 3. The optimizer's own tensors are
measured against this in ``memory_report``; Ψ there is the padded element count of the flat
buffers, which is what a rank really allocates.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelStateBytes:
    params: float
    grads: float
    master: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.master + self.optimizer


def zero_model_state_bytes(numel: float, dp: int, stage: int, param_bytes: int = 2, grad_bytes: int = 2,
                           master_bytes: int = 4, moment_bytes: int = 8, full_grads: bool = False,
                           param_shard: bool = True) -> ModelStateBytes:
    """Per-device bytes; ``full_grads`` is the once-per-step pipeline mode of stages 2 and 3;
    ``param_shard``: stage 3 keeps a 16-bit copy of its parameter shard, the paper's pΨ/Nd
    (megazero's does only where the master is offloaded: it rounds the master as it gathers)."""
    shard = numel / dp
    params = numel if stage < 3 else shard if param_shard else 0.0
    grads = numel if stage < 2 or full_grads else shard
    states = numel if stage == 0 else shard
    return ModelStateBytes(params * param_bytes, grads * grad_bytes, states * master_bytes, states * moment_bytes)


def memory_report(measured: dict[str, int], predicted: ModelStateBytes, rank: int, stage: int) -> str:
    """One line per rank: what each category holds, next to the formula's figure."""
    gib = 2.0**30
    parts = []
    for name in ("params", "grads", "master", "optimizer"):
        parts.append(f"{name} {measured[name] / gib:.3f}/{getattr(predicted, name) / gib:.3f}")
    total = sum(measured.values())
    return (f"[rank {rank}] ZeRO-{stage} model states, GiB measured/formula: " + ", ".join(parts)
            + f"; total {total / gib:.3f}/{predicted.total / gib:.3f}")
