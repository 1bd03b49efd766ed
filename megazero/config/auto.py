"""The settings a config may leave to the run (``parallel.tp_comm auto``, ``train.cuda_graphs`` and
``train.compile`` null), resolved once the device is known.

Tensor parallelism with sequence parallelism inside a node runs fastest with its linears exchanging
tokens through peer memory, in blocks replayed as CUDA graphs. On two H200s (BENCHMARKS.md, "Auto
settings"), tp 2 + sp ran GPT 1.3B at 0.85 of one GPU's tokens/s per GPU this way against 0.76 with
NCCL beside the products; at micro-batch 4 it ran 1.95x faster and at 350M 2.6x, where launching the
kernels of blocks that are not replayed sets the pace. Neither half pays on its own: peer memory
without graphs spread by 12% between runs of one command, around NCCL's figure, and graphs with NCCL
gained half as much. So ``auto`` and null pick the pair together where both can run, and NCCL beside
the products, without graphs, everywhere else (CPU, GPUs without peer access, tp groups across
nodes, pipelines, ZeRO-3, recompute, dropout, fp16, the host optimizer). A value set in the config
is kept, and validation refuses one that cannot run.
"""

from __future__ import annotations

import dataclasses

from megazero.config.schema import Config
from parallel.pipeline.schedule import SPLIT_BACKWARD

TP_COMM_AUTO = "auto"


def graph_blockers(cfg: Config) -> list[str]:
    """The settings of ``cfg`` that blocks replayed as CUDA graphs cannot run with, each as the field
    and its value. A replayed graph reads its parameters at the addresses it was recorded with, so
    ZeRO-3, which regathers them into new memory, cannot replay. The rest are untested with the
    engine's replay, and some would fail silently: a pipeline's several forwards in flight (whose sent
    outputs it frees), a split backward's deferred weight gradients, recompute's forwards inside
    backward, and dropout (the tensor-parallel random stream is forked on the host, where a replay
    would not see it)."""
    t, p, m = cfg.train, cfg.parallel, cfg.model
    blockers = [(t.compile is False, "train.compile false"), (t.device == "cpu", "train.device cpu"),
                (p.pp > 1, f"parallel.pp {p.pp}"), (cfg.zero.stage == 3, "zero.stage 3"),
                (p.pipeline_schedule in SPLIT_BACKWARD, f"parallel.pipeline_schedule {p.pipeline_schedule}"),
                (p.recompute != "none", f"parallel.recompute {p.recompute}"),
                (m.dropout > 0 or m.attention_dropout > 0, "model.dropout or model.attention_dropout above 0")]
    return [what for blocked, what in blockers if blocked]


def resolve_auto(cfg: Config, on_cuda: bool, peer_memory: bool) -> Config:
    """``cfg`` with ``train.compile``, ``parallel.tp_comm`` and ``train.cuda_graphs`` set, for a run on
    CUDA devices (``on_cuda``) whose torch can map peer memory (``peer_memory``) or not.

    ``tp_comm auto`` becomes ``peer_memory`` where the blocks will replay as graphs and the tokens can
    move through peer memory (sequence parallel, one node), else ``overlap``; ``cuda_graphs`` null
    becomes true where the blocks can replay and the linears use peer memory, else false (and with
    fp16 or the host optimizer, which no GPU test has run in graphs). ``peer_memory``: every rank's
    GPU can map its peers' memory (``engine._peer_memory_everywhere``)."""
    p, t = cfg.parallel, cfg.train
    compile_ = t.compile if t.compile is not None else on_cuda
    graphs_run = on_cuda and compile_ and not graph_blockers(cfg)
    # graphs run with fp16's loss scaling and the host optimizer too, but the defaults choose them
    # only where the GPU tests have run them
    graphs_tested = cfg.precision.dtype != "fp16" and not cfg.zero.offload_optimizer
    graphs_wanted = t.cuda_graphs if t.cuda_graphs is not None else graphs_run and graphs_tested
    peer_run = on_cuda and peer_memory and p.sequence_parallel and not p.allow_tp_across_nodes
    tp_comm = p.tp_comm
    if tp_comm == TP_COMM_AUTO:
        tp_comm = "peer_memory" if peer_run and graphs_wanted else "overlap"
    graphs = t.cuda_graphs if t.cuda_graphs is not None else graphs_wanted and tp_comm == "peer_memory"
    return dataclasses.replace(cfg, parallel=dataclasses.replace(p, tp_comm=tp_comm),
                               train=dataclasses.replace(t, compile=compile_, cuda_graphs=graphs))
