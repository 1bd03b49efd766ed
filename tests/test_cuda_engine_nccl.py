"""The engine in bf16 on two GPUs over NCCL tracks single-process fp32 AdamW.

The CPU suite runs every layout over gloo in fp32; what only a GPU exercises is NCCL itself (its
reduce-scatter and all-gather into bucket views, the batched point-to-point of the pipeline), the
CUDA fused AdamW with its device-side unscale and skip, and bf16 kernels. Each layout of two ranks,
(tp, pp, dp) = (1,1,2) under ZeRO 1, 2 and 3, (2,1,1) without sequence parallelism and with it in each
of its communication modes, also recomputed (whole blocks; the attention core under sequence
parallelism), and (1,2,1) under 1F1B and ZB-H2 (eager, and compiled: the deferred plain linears stay out
of the graphs), and with the blocks replayed as CUDA graphs (tp 2 with and without
sp, with sp in each communication mode and at the defaults, which choose peer memory there, dp 2 under
ZeRO 2; replays counted, so a silent fallback to the plain path fails), trains 3 steps
in bf16 and is compared with the fp32 reference of ``tests/test_engine_equivalence.py`` on the same
global batches: the reported gradient norm every step within 2%, the losses within 2%, and the whole
update of the 16-bit weights within 20% relative error (bf16 rounds the weights themselves, by up to
2^-9 of their size); then it evaluates the last global batch (the engine's loss is the mean over
data-parallel ranks) within 2% of the trained reference's loss on it. Every rank is checked. On four
GPUs, the three-axis layouts too: tp 2 x pp 2 with sequence parallelism under the zero-bubble
schedule (the deferred halves of the sequence-parallel operators, over NCCL and through peer
memory, eager, and compiled with the operators handing their weight gradients over from inside the
graph), tp 2 x dp 2 (also as CUDA graphs, through peer memory) and pp 2 x dp 2. Where flash-attn-4 is
installed on a Hopper GPU, every case runs its attention through FlashAttention 4 (the pair bound of
``kernels.flash_attention_fits`` set to 0 for these small shapes), and its calls are counted.

(Skipped unless two CUDA devices are visible; the four-GPU cases unless four are.)
"""

from __future__ import annotations

import collections
import functools

import pytest
import torch

from megazero.engine import Engine
from models import GPT, kernels
from parallel.tensor_parallel import peer_memory
from parallel.tensor_parallel.sharding import param_shards
from parallel.topology import RankGrid, Topology
from tests.distributed import run_world
from tests.test_engine_equivalence import MICROS_PER_RANK, STEPS, _batches, _config, _reference

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

SP, ZB = ("--parallel.sequence_parallel", "true"), ("--parallel.pipeline_schedule", "zb-h1")
ZB2 = ("--parallel.pipeline_schedule", "zb-h2")
CG, NO_CG = ("--train.cuda_graphs", "true"), ("--train.cuda_graphs", "false")
CASES = [((1, 1, 2), 1, ()), ((1, 1, 2), 2, ()), ((1, 1, 2), 3, ()),
         ((2, 1, 1), 1, ()), ((2, 1, 1), 1, (*SP, *NO_CG)),
         ((2, 1, 1), 1, (*SP, "--parallel.tp_comm", "peer_memory", *NO_CG)),
         ((2, 1, 1), 1, (*SP, "--parallel.tp_comm", "serial")),
         ((2, 1, 1), 1, ("--parallel.recompute", "full")), ((2, 1, 1), 1, (*SP, "--parallel.recompute", "selective")),
         ((1, 2, 1), 1, ()), ((1, 2, 1), 1, ("--parallel.virtual_stages", "2")),
         ((1, 2, 1), 1, ("--parallel.virtual_stages", "2", "--parallel.pipeline_schedule", "interleaved_zb")),
         ((1, 2, 1), 1, ZB2), ((1, 2, 1), 1, (*ZB2, "--train.compile", "true")),
         ((1, 2, 1), 1, (*ZB2, "--train.compile", "true", "--parallel.pipeline_split", "[1.5, 2.5]")),
         ((1, 2, 1), 1, ("--parallel.virtual_stages", "2", "--parallel.pipeline_schedule", "zb-v", "--train.compile",
                         "true"))]
# the defaults at tp 2 + sp on GPUs: peer-memory linears in blocks replayed as CUDA graphs
DEFAULTS_SP = ((2, 1, 1), 1, SP)
CASES_CG = [((2, 1, 1), 1, (*SP, "--parallel.tp_comm", "overlap", *CG)),
            ((2, 1, 1), 1, (*SP, "--parallel.tp_comm", "serial", *CG)),
            ((2, 1, 1), 1, (*SP, "--parallel.tp_comm", "peer_memory", *CG)), DEFAULTS_SP,
            ((2, 1, 1), 1, CG),
            ((1, 1, 2), 2, CG)]


class _CountedFlash:
    """Counts the calls of FlashAttention 4's forward kernel launcher while active. It is patched below
    the custom op (whose body dynamo does not trace), not at the seam: a counting wrapper inside a
    compiled block would change what dynamo traces (the blocks then never replayed as CUDA graphs).
    Replayed graphs launch without Python, so the recorded and warm-up calls are what is counted."""

    def __enter__(self):
        self.calls = 0
        if kernels.HAS_FLASH:
            from flash_attn.cute import interface

            self._interface, self._original = interface, interface._flash_attn_fwd

            @functools.wraps(self._original)  # with its attributes: it reads its kernel cache off itself
            def forward(*args, **kwargs):
                self.calls += 1
                return self._original(*args, **kwargs)
            interface._flash_attn_fwd = forward
        return self

    def __exit__(self, *exc):
        if kernels.HAS_FLASH:
            self._interface._flash_attn_fwd = self._original


def _flash_expected() -> bool:
    return kernels.HAS_FLASH and torch.cuda.get_device_capability()[0] == 9


class _CountedReplays:
    """Counts each CUDA graph's replays while active (recording replays a graph once too): a torch
    that fell back to running a block, or only its backward, without graphs (it may, silently) would
    leave a CUDA-graph case testing the plain path."""

    def __enter__(self):
        self.counts, self._original = collections.Counter(), torch.cuda.CUDAGraph.replay

        def replay(graph):
            self.counts[id(graph)] += 1
            return self._original(graph)
        torch.cuda.CUDAGraph.replay = replay
        return self

    def __exit__(self, *exc):
        torch.cuda.CUDAGraph.replay = self._original


def _case(topo, layout, stage, extra) -> dict:
    tp, pp, dp = layout
    cfg = _config(tp, pp, dp, stage, ("--precision.dtype", "bf16", "--train.device", "cuda", *extra))
    torch._dynamo.reset()  # each case compiles afresh, far from the limit of recompilations per function
    engine = Engine(cfg, topo, torch.device("cuda", torch.cuda.current_device()))
    losses, norms = [], []
    with _CountedReplays() as replays, _CountedFlash() as flash:
        for step in range(STEPS):
            batches = _batches(step, dp)
            mine = batches[topo.dp_rank * MICROS_PER_RANK:(topo.dp_rank + 1) * MICROS_PER_RANK]
            out = engine.train_step(mine)
            losses.append(out.loss)
            norms.append(out.result.grad_norm)
    eval_loss = engine.eval_loss(mine)
    engine.data_parallel.wait_params()
    initial = dict(GPT(cfg.model, vocab_multiple=128 * tp, seed=cfg.train.seed).named_parameters())
    reference, ref_losses, ref_norms = _reference(cfg, dp)
    trained = dict(reference.named_parameters())
    with torch.no_grad():
        ref_eval = (sum(reference(mb["tokens"], mb["labels"]).mean() for mb in batches) / len(batches)).item()
    diff_sq = update_sq = 0.0
    for chunk in engine.chunks:
        shards = param_shards(chunk)
        for name, p in chunk.named_parameters():
            key = "embedding.tokens.weight" if name == "lm_head.weight" and name not in trained else name
            after, before = trained[key].detach(), initial[key].detach()
            if name in shards:
                after, before = shards[name].take(after), shards[name].take(before)
            diff_sq += (p.detach().float().cpu() - after).pow(2).sum().item()
            update_sq += (after - before).pow(2).sum().item()
    return {"tp_comm": engine.cfg.parallel.tp_comm, "cuda_graphs": engine.cfg.train.cuda_graphs,
            "barrier_timeout_s": peer_memory.barrier_timeout_ms(topo.tp_group.group_name) / 1000,
            "collective_timeout_s": cfg.train.collective_timeout_s,
            "norm_err": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
            "loss_err": max(abs(a - b) / b for a, b in zip(losses, ref_losses)),
            "update_err": (diff_sq / update_sq) ** 0.5,
            "graphs_replayed_3x": sum(n >= 3 for n in replays.counts.values()), "graphs": len(replays.counts),
            "eval_err": abs(eval_loss - ref_eval) / ref_eval,
            "blocks": cfg.model.num_layers // pp, "flash_calls": flash.calls}


CASES4 = [((2, 2, 1), 1, (*SP, *ZB)), ((2, 2, 1), 1, (*SP, *ZB, "--parallel.tp_comm", "peer_memory")),
          # compiled: the sequence-parallel operators hand their weight gradients over from inside the graph
          ((2, 2, 1), 1, (*SP, *ZB2, "--train.compile", "true")),
          ((2, 2, 1), 1, (*SP, *ZB2, "--train.compile", "true", "--parallel.tp_comm", "peer_memory")),
          ((2, 1, 2), 2, (*SP, *NO_CG)), ((1, 2, 2), 1, ()), ((2, 1, 2), 2, (*SP, *CG))]


def _all_cases(rank: int, world_size: int, cases: list) -> dict:
    kernels.FLASH_PAIRS_PER_MULTIPROCESSOR = 0  # FlashAttention 4 on these shapes, where installed
    report = {}
    for layout, stage, extra in cases:
        topo = Topology(RankGrid(tp=layout[0], pp=layout[1], dp=layout[2]))
        report[(layout, stage, extra)] = _case(topo, layout, stage, extra)
    return report


@pytest.fixture(scope="module")
def reports():
    return run_world(2, _all_cases, CASES + CASES_CG, timeout=900, backend="nccl")


@pytest.fixture(scope="module")
def reports4():
    if torch.cuda.device_count() < 4:
        pytest.skip("needs four CUDA devices")
    return run_world(4, _all_cases, CASES4, timeout=600, backend="nccl")


def _check(reports, layout, stage, extra):
    for rank, report in enumerate(reports):
        value = report[(layout, stage, extra)]
        assert value["norm_err"] < 0.02, (rank, value)
        assert value["loss_err"] < 0.02, (rank, value)
        assert value["update_err"] < 0.2, (rank, value)
        assert value["eval_err"] < 0.02, (rank, value)  # the trained model's loss on the last global batch
        if value["cuda_graphs"]:
            # a forward and a backward graph per block, each recorded (one replay) and then replayed on
            # the later micro-batches (of 2 x 3 per rank: one warms up, one records, four replay)
            assert value["graphs_replayed_3x"] >= 2 * value["blocks"], (rank, value)
        else:
            assert value["graphs"] == 0, (rank, value)
        assert (value["flash_calls"] > 0) == _flash_expected(), (rank, value)


@pytest.mark.parametrize("layout, stage, extra", CASES)
def test_bf16_on_nccl_tracks_fp32_reference(reports, layout, stage, extra):
    _check(reports, layout, stage, extra)


@pytest.mark.parametrize("layout, stage, extra", CASES_CG)
def test_cuda_graphs_on_nccl_track_fp32_reference(reports, layout, stage, extra):
    _check(reports, layout, stage, extra)


def test_defaults_replay_peer_memory_linears_as_cuda_graphs(reports):
    """What ``DEFAULTS_SP`` resolved to (its graphs are counted by ``_check``)."""
    for report in reports:
        value = report[DEFAULTS_SP]
        assert (value["tp_comm"], value["cuda_graphs"]) == ("peer_memory", True), value
        assert value["barrier_timeout_s"] == 2 * value["collective_timeout_s"], value  # behind the deadlines


@pytest.mark.parametrize("layout, stage, extra", CASES4)
def test_three_axes_on_four_gpus_track_fp32_reference(reports4, layout, stage, extra):
    _check(reports4, layout, stage, extra)
