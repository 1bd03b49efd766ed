"""The real GPT through 1F1B and interleaved pipelines equals one process, tied embeddings included.

Stage parameters keep the full model's names, so each rank compares its gradients with a full
reference model by name (its tensor-parallel slice of it, under tp); the last stage's tied head copy
is compared with the reference embedding. With tp = 2 the stages are tensor-parallel through
``models.parallelize`` (vocabulary-parallel embedding and loss), optionally sequence-parallel, and
the activations crossing stages are the sequence-sharded ones. The Llama preset (rotary, RMSNorm,
SwiGLU, a grouped key/value head, untied head: the head's gradient is its own, not the embedding's)
runs interleaved and tensor-parallel too. One 4-rank world runs every case.
"""

from __future__ import annotations

import time

import pytest
import torch

from models import GPT
from models.config import ModelConfig
from models.parallelize import tensor_parallelize_gpt
from parallel.tensor_parallel.partial_grads import sum_partial_grads
from models.presets import MODEL_PRESETS
from parallel.pipeline import PipelineExecutor, allreduce_data_parallel_grads, sum_tied_grads
from parallel.pipeline.partition import resolve_split, stage_layers
from parallel.tensor_parallel.sharding import param_shards
from parallel.topology import RankGrid, Topology
from tests.distributed import run_world

CFG = dict(num_layers=4, hidden_size=16, num_heads=2, vocab_size=40, seq_length=8, tie_embeddings=True)
PRESETS = {"gpt2": CFG, "llama": dict(CFG, **MODEL_PRESETS["llama"], num_heads=4, num_kv_heads=2)}
MICRO = 2
TOL = 2e-5  # fp32, relative to the largest reference gradient


def forward_step(module, x, microbatch, first, last):
    inputs, labels = microbatch
    out = module(inputs if first else x, labels if last else None)
    return out.mean() if last else out


def _data(count):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 40, (MICRO, 8), generator=g), torch.randint(0, 40, (MICRO, 8), generator=g))
            for _ in range(count)]


def _case(topo, schedule, m, v, sp, preset="gpt2"):
    cfg = ModelConfig(**PRESETS[preset])
    pp, rank, dp, tp = topo.pp_size, topo.pp_rank, topo.dp_size, topo.tp_size
    split = resolve_split(cfg.num_layers, pp, v)
    chunks = []
    for c in range(v):
        stage = c * pp + rank
        chunk = GPT(cfg, layers=stage_layers(split, pp, rank, c), has_embedding=stage == 0,
                    has_head=stage == pp * v - 1, vocab_multiple=128 * tp, seed=7)
        chunks.append(tensor_parallelize_gpt(chunk, topo.tp_group, seed=7, sequence_parallel=sp) if tp > 1 else chunk)
    shape = (MICRO, cfg.seq_length // tp if sp else cfg.seq_length, cfg.hidden_size)
    executor = PipelineExecutor(chunks, topo, shape, schedule=schedule, forward_step=forward_step, timeout_s=60)
    data = _data(dp * m)
    loss = executor.step(data[topo.dp_rank * m:(topo.dp_rank + 1) * m])
    for chunk in chunks:
        sum_partial_grads(chunk, topo.tp_group)
    if cfg.tie_embeddings:
        tied = [p for ch in chunks for p in ([ch.embedding.tokens.weight] if ch.embedding else [])
                + ([ch.lm_head.weight] if ch.lm_head else [])]
        sum_tied_grads([p.grad for p in tied if p.grad is not None], topo.embedding_group)
    allreduce_data_parallel_grads([p for ch in chunks for p in ch.parameters()], topo)

    ref = GPT(cfg, vocab_multiple=128 * tp, seed=7)
    ref_loss = torch.stack([forward_step(ref, None, mb, True, True) for mb in data]).mean()
    ref_loss.backward()
    ref_grads = dict(ref.named_parameters())
    scale = max(p.grad.abs().max().item() for p in ref.parameters())
    worst, checked = 0.0, 0
    for ch in chunks:
        shards = param_shards(ch)
        for name, p in ch.named_parameters():
            tied_head = name == "lm_head.weight" and cfg.tie_embeddings
            expect = ref_grads["embedding.tokens.weight" if tied_head else name].grad
            expect = shards[name].take(expect) if name in shards else expect
            worst = max(worst, (p.grad - expect).abs().max().item())
            checked += 1
    return {"loss": loss.item(), "ref_loss": ref_loss.item(), "grad_error": worst / scale, "checked": checked}


CASES = [((1, 2, 2), "1f1b", 3, 1, False), ((1, 2, 2), "interleaved_1f1b", 4, 2, False),
         ((1, 4, 1), "1f1b", 4, 1, False), ((1, 4, 1), "1f1b", 5, 1, False),
         ((1, 2, 2), "gradient_accumulation", 2, 1, False), ((2, 2, 1), "1f1b", 3, 1, False),
         ((2, 2, 1), "1f1b", 2, 1, True), ((2, 2, 1), "interleaved_1f1b", 4, 2, True),
         ((1, 2, 2), "interleaved_1f1b", 4, 2, False, "llama"), ((2, 2, 1), "1f1b", 3, 1, True, "llama")]


def _world4(rank, world_size):
    torch.manual_seed(0)
    out, topos = {}, {}
    for case in CASES:
        layout = case[0]
        if layout not in topos:
            topos[layout] = Topology(RankGrid(tp=layout[0], pp=layout[1], dp=layout[2]))
        out[case] = _case(topos[layout], *case[1:])
    out["wrong_shape"] = _wrong_shape(topos[(1, 2, 2)])  # last: it leaves the pipeline group unusable
    return out


def _wrong_shape(topo):
    """A pipeline told the wrong activation shape stops with errors naming it, on every rank, fast."""
    cfg = ModelConfig(**CFG)
    first, last = topo.is_first_stage, topo.is_last_stage
    stage = GPT(cfg, layers=range(2) if first else range(2, 4), has_embedding=first, has_head=last)
    executor = PipelineExecutor([stage], topo, (MICRO, cfg.seq_length + 1, cfg.hidden_size),
                                forward_step=forward_step, timeout_s=3)
    try:
        executor.step(_data(2))
    except ValueError as err:
        # Stay connected until the peers' 3 s receive timeout has passed: exiting at once would close
        # the gloo pairs and the peers would see "connection closed" instead of their own timeout.
        time.sleep(6)
        return f"{type(err).__name__}: {err}"
    except RuntimeError as err:
        return f"{type(err).__name__}: {err}"
    return "finished"


@pytest.fixture(scope="module")
def world4():
    return run_world(4, _world4, timeout=180)


def _ids(case):
    (tp, pp, dp), schedule, m, v, sp, *preset = case
    return f"tp{tp}-pp{pp}-dp{dp}-{schedule}-m{m}" + ("-sp" if sp else "") + "".join(f"-{p}" for p in preset)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_gpt_pipeline_equals_single_process(world4, case):
    total = 0
    for rank, result in enumerate(world4):
        r = result[case]
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5), f"rank {rank}"
        assert r["grad_error"] <= TOL, f"rank {rank}: relative gradient error {r['grad_error']:.2e}"
        total += r["checked"]
    assert total > 0


def test_wrong_activation_shape_is_named_and_peers_time_out(world4):
    for rank, result in enumerate(world4):
        message = result["wrong_shape"]
        if rank in (0, 1):  # pipeline rank 0 of each data-parallel replica (tp-dp-pp order)
            assert message.startswith("ValueError") and "(2, 9, 16)" in message and "(2, 8, 16)" in message
        else:
            assert message.startswith("PipelineTimeout") and "recv act(mb0 from stage 0)" in message
