"""The machines the planner plans for: one GPU's memory, speed and links, and how many there are.

A preset holds datasheet figures (memory, dense 16-bit peak, HBM bandwidth, per-GPU NVLink and
InfiniBand bandwidth in one direction) and measured figures: ``efficiency``, the fraction of peak
that a GPT's matrix work reaches on that GPU in practice, and, where measured, ``block_overhead_s``,
what each block's kernels cost a micro-batch whatever its token count. The step-time model divides
FLOPs by ``peak * efficiency``, adds each micro-batch's fixed cost, and what it predicts for
communication and pipeline bubbles on top, so both are meant to be measured where those are absent
or small (one GPU, or data parallelism that overlaps its reduction). Each constant below says where
it came from; ``benchmarks/planner_gpu.py`` measures the efficiency again on a lent GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

GIB = 2.0**30

# Fraction of the link's datasheet bandwidth that NCCL's collectives reach in practice (nccl-tests
# bus bandwidth on DGX A100/H100 reaches about 75-85% of the NVLink and NIC line rates).
LINK_EFFICIENCY = 0.8

# A100: Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM"), Table 1: the 1.7B GPT (24 layers, hidden 2304, sequence 2048) trained with data
# parallelism only on 32 DGX A100 GPUs, full recompute, batch 512, reaches 137 TFLOP/s per GPU = 44% of
# the 312 TFLOP/s peak end to end. Megatron then all-reduced the fp16 gradients after the backward
# pass, not during it: 2 * 31/32 * 1.7e9 * 2 bytes at 20 GB/s per GPU is 0.33 s of a 3.6 s step. The
# compute alone therefore ran at 137 * 3.6 / (3.6 - 0.33) = 150 TFLOP/s, 48% of peak.
A100_EFFICIENCY = 0.48
# H100 and H200 (same dense peak): the GPT 1.3B of configs/gpt_1.3b.yaml, compiled, on one H200 with 16
# sequences a step in micro-batches of 1, 2, 4, 8 and 16 (BENCHMARKS.md, "The planner's micro-batch
# term"): the steps lie on a line of 10.35 ms per micro-batch plus 486 ms for the step's 32,768
# tokens once the optimizer step is taken out, i.e. the tokens' matrix work at 62% of peak. Of the
# 10.35 ms, 4.1 are the weights' traffic the time model derives (``planner.time``), the rest, 6.2 ms,
# is 0.26 ms per block: its kernels' start and drain, and products too small to fill every
# multiprocessor. (Before this term: 0.58 at micro-batch 8 alone, megazero train on one H100.)
H100_EFFICIENCY = 0.62
H100_BLOCK_OVERHEAD_S = 0.26e-3
# Tensor-parallel collectives: the fraction of the NVLink datasheet bandwidth that the exposed
# sequence-parallel all-gathers and reduce-scatters effectively reach, everything they cost around
# the GEMMs included (smaller per-rank GEMMs, the extra elementwise passes). A100: the link
# efficiency above, which reproduces MT-NLG's tp 8 within 7%. H100/H200: fitted to megazero's own tp 2
# runs of the 1.3B GPT with sequence parallelism on H200s (BENCHMARKS.md): 165.9 ms a step of one
# micro-batch of 8 on two GPUs, and within 6% the same model's step at micro-batch 4 (host-bound), at
# tp 2 x dp 2 and at tp 2 x pp 2. This figure is megazero's, not the hardware's: it was 0.19 for the
# tensor-parallel path of 2026-11-26 morning, before the overlapped linears, and changes with that path.
H100_TP_LINK_EFFICIENCY = 0.45
# V100: the ZeRO paper (Rajbhandari et al. 2020), section X-B: ZeRO-100B sustains "over 30% of the
# peak" on 400 V100s for 8B-100B models.
V100_EFFICIENCY = 0.30


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    peak_tflops: float       # dense bf16/fp16 (fp32 runs use the same figure: the planner plans 16-bit runs)
    hbm_GBps: float          # device memory bandwidth: the optimizer step is bound by it
    intra_node_GBps: float   # NVLink/NVSwitch, per GPU, one direction
    inter_node_GBps: float   # the node's InfiniBand divided among its GPUs, per GPU, one direction
    efficiency: float
    tp_link_efficiency: float = LINK_EFFICIENCY  # what tensor-parallel collectives reach (see above)
    # per block and micro-batch (see above); None where ``efficiency`` comes from a published end-to-end
    # figure, whose run's fixed costs it already holds at that run's micro-batch, which the source
    # does not state
    block_overhead_s: Optional[float] = None

    @property
    def flops(self) -> float:
        """FLOP/s the planner expects a GPU to sustain on a GPT's matrix work."""
        return self.peak_tflops * 1e12 * self.efficiency


# Memory is what torch reports as a device's ``total_memory`` (what the start-up check measures a
# run against), not the datasheet's gigabytes: 32,494 MiB on a V100 32GB, 81,251 on an A100-SXM4-80GB
# and 81,089 on an H100 80GB HBM3 as printed in public logs, 139.80 GiB on the H200s this project
# benchmarks on (BENCHMARKS.md); rounded down, never up. A plan at 80 GiB passed layouts the start-up
# check then refused.
GPUS = {
    # DGX-2: 16 GPUs on NVSwitch (150 GB/s each way), 8 x 100 Gb/s EDR InfiniBand per node.
    "v100-32gb": GPU("V100-SXM3-32GB", 31.7, 125.0, 900.0, 150.0, 8 * 100 / 8 / 16, V100_EFFICIENCY),
    # DGX A100: NVLink 3 (300 GB/s each way), 8 x 200 Gb/s HDR InfiniBand per node of 8.
    "a100-80gb": GPU("A100-SXM4-80GB", 79.3, 312.0, 2039.0, 300.0, 200 / 8, A100_EFFICIENCY),
    # DGX H100: NVLink 4 (450 GB/s each way), 8 x 400 Gb/s NDR InfiniBand per node of 8.
    "h100": GPU("H100-SXM5-80GB", 79.18, 989.0, 3350.0, 450.0, 400 / 8, H100_EFFICIENCY, H100_TP_LINK_EFFICIENCY,
                H100_BLOCK_OVERHEAD_S),
    # HGX H200: as the H100 with 141 GB of faster HBM3e.
    "h200": GPU("H200-SXM-141GB", 139.8, 989.0, 4800.0, 450.0, 400 / 8, H100_EFFICIENCY, H100_TP_LINK_EFFICIENCY,
                H100_BLOCK_OVERHEAD_S),
}


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    num_gpus: int
    gpus_per_node: int

    @property
    def nodes(self) -> int:
        return -(-self.num_gpus // self.gpus_per_node)

    def link_bytes_per_s(self, within_node: bool, tensor_parallel: bool = False) -> float:
        """Achievable bytes/s one GPU sends over the link a group of GPUs uses (a tensor-parallel
        group's exposed collectives: ``tp_link_efficiency``)."""
        GBps = self.gpu.intra_node_GBps if within_node else self.gpu.inter_node_GBps
        return GBps * 1e9 * (self.gpu.tp_link_efficiency if tensor_parallel else LINK_EFFICIENCY)


def custom_gpu(base: GPU, memory_gib=None, peak_tflops=None, intra_node_GBps=None, inter_node_GBps=None) -> GPU:
    """``base`` with the figures given (not None) replaced: a GPU that has no preset, or a cluster
    whose network differs from the reference design."""
    changes = {k: v for k, v in dict(memory_gib=memory_gib, peak_tflops=peak_tflops, intra_node_GBps=intra_node_GBps,
                                     inter_node_GBps=inter_node_GBps).items() if v is not None}
    return replace(base, **changes)
