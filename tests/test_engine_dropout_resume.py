"""Dropout across tensor and pipeline ranks, and an exact resume of its generators, on a real 2-rank
world (tp 2; one case pp 2).

Every equivalence test runs with dropout 0, where the generators do not matter. Here dropout and
attention dropout are 0.1 under tensor parallelism, with and without sequence parallelism:

* replicated regions draw the same mask on both tensor ranks and sharded regions their own: after
  training, every replicated parameter (norms, biases of row-parallel layers, ...) is bitwise
  equal on the two ranks, which a replicated mask drawn differently per rank breaks at once;
* a run saved after 2 steps and resumed into a fresh engine (whose generators start from the seed
  again) continues with exactly the losses of the uninterrupted run, bit for bit;
* the same resume without restoring the generators (the resharding path, which does not carry
  them) gives other losses, so the exact comparison above does depend on the restored state, and
  so does dropout 0 (dropout really is on);
* at pp 2 the two stages draw different masks: the k-th residual-branch mask the second stage draws
  is not the k-th the first draws (it was, mask for mask: one seed on every pipeline rank); the
  tensor-parallel streams of two chunks made stages 0 and 1 differ too;
* evaluation runs without dropout: its loss is that of the same weights built with dropout 0; the
  training step after it draws its masks again.

The CUDA generator, absent here, is checked through a stand-in: captured and put back with the rest.

Planted bugs this caught: the generators' state not restored on a same-layout resume, and the
tensor-parallel generator's offset applied to the replicated stream as well.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megazero.checkpoint import CheckpointWriter, read_manifest, step_dir_name
from megazero.checkpoint.state import load_checkpoint, rank_files
from megazero.config import load_config
from megazero.engine import Engine
from models import GPT
from models.config import ModelConfig
from models.parallelize import Parallelism, parallelize_gpt
from parallel.tensor_parallel.sharding import param_shards
from parallel.topology import RankGrid, Topology
from tests.distributed import run_world

STEPS, SAVED_AT, VOCAB, SEQ = 4, 2, 61, 16


def _engine(topo, sp: bool, dropout: float = 0.1, tp: int = 2, pp: int = 1, zero: int = 1) -> Engine:
    cfg = load_config(None, ["--model.num_layers", "2", "--model.hidden_size", "32", "--model.num_heads", "4",
                             "--model.vocab_size", str(VOCAB), "--model.seq_length", str(SEQ),
                             "--model.dropout", str(dropout), "--model.attention_dropout", str(dropout),
                             "--parallel.tp", str(tp), "--parallel.pp", str(pp),
                             "--parallel.sequence_parallel", str(sp).lower(),
                             "--zero.stage", str(zero), "--train.micro_batch_size", "2", "--train.global_batch_size", "4",
                             "--train.device", "cpu", "--optimizer.lr", "1e-2", "--train.seed", "3"])
    return Engine(cfg, topo, torch.device("cpu"))


def _step(engine, step: int) -> float:
    g = torch.Generator().manual_seed(50 + step)
    tokens = torch.randint(0, VOCAB, (2, 2, SEQ + 1), generator=g)
    return engine.train_step([{"tokens": t[:, :-1], "labels": t[:, 1:]} for t in tokens]).loss


def _replicated_differing_across_tp(engine, topo) -> list[str]:
    """Names of replicated parameters whose values differ between the tensor ranks."""
    engine.data_parallel.wait_params()
    differ = []
    for chunk in engine.chunks:
        shards = param_shards(chunk)
        for name, p in chunk.named_parameters():
            if name not in shards:
                copies = [torch.empty_like(p) for _ in range(topo.tp_size)]
                dist.all_gather(copies, p.detach().contiguous(), group=topo.tp_group)
                if not all(torch.equal(c, copies[0]) for c in copies):
                    differ.append(name)
    return differ


def _resumed(topo, rank, ckpt, sp: bool, exact: bool, zero: int = 1) -> list[float]:
    """Losses after loading ``ckpt`` into a fresh engine of ZeRO stage ``zero``; ``exact=False`` takes
    the resharding path, which restores weights and moments but not the generators (a rank that
    moved); at another ZeRO stage the ranks stay where they were, and take their generators."""
    torch.manual_seed(1234)  # a fresh process's generators: whatever they hold must be replaced
    target = _engine(topo, sp, zero=zero)
    restored = load_checkpoint(ckpt, rank, target.chunks, target.optimizer, read_manifest(ckpt), same_ranks=exact)
    assert restored == exact or zero != 1  # ZeRO-3's shards may be ZeRO-1's, and load exactly
    return [_step(target, step) for step in range(SAVED_AT, STEPS)]


def _case(topo, rank, root, sp: bool) -> dict:
    full = _engine(topo, sp)
    want = [_step(full, step) for step in range(STEPS)]
    replicated_differ = _replicated_differing_across_tp(full, topo)

    source = _engine(topo, sp)
    for step in range(SAVED_AT):
        _step(source, step)
    writer = CheckpointWriter(root, rank=rank, world_size=2, barrier=dist.barrier)
    writer.save(SAVED_AT, rank_files(source.chunks, source.optimizer, rank), meta={"step": SAVED_AT})
    ckpt = f"{root}/{step_dir_name(SAVED_AT)}"
    return {"want": want, "resumed": _resumed(topo, rank, ckpt, sp, exact=True),
            "resumed_zero3": _resumed(topo, rank, ckpt, sp, exact=True, zero=3),
            "without_rng": _resumed(topo, rank, ckpt, sp, exact=False),
            "no_dropout": _step(_engine(topo, sp, dropout=0.0), 0), "replicated_differ": replicated_differ}


def _stages_share_masks(topo) -> list[int]:
    """At pp 2: the positions k at which the second stage's k-th residual-branch dropout mask of a step
    equals the first stage's k-th (every such mask is [micro-batch, seq, hidden])."""
    engine = _engine(topo, sp=False, tp=1, pp=2)
    masks = []
    for chunk in engine.chunks:
        for module in chunk.modules():
            if isinstance(module, torch.nn.Dropout):
                module.register_forward_hook(lambda m, args, out: masks.append((out == 0) & (args[0] != 0)))
    _step(engine, 0)
    both = [torch.empty_like(torch.stack(masks[:4])) for _ in range(2)]
    dist.all_gather(both, torch.stack(masks[:4]), group=topo.pp_group)
    return [k for k in range(4) if torch.equal(both[0][k], both[1][k])]


def _stage_tp_streams_agree(topo) -> bool:
    """Whether two chunks made pipeline stages 0 and 1 by ``parallelize_gpt`` draw the same numbers from
    their tensor-parallel streams (those of attention dropout, on this rank's heads)."""
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, vocab_size=VOCAB, seq_length=SEQ,
                      attention_dropout=0.1)
    chunks = [GPT(cfg, layers=[stage], has_embedding=stage == 0, has_head=stage == 1, vocab_multiple=256,
                  device="meta") for stage in (0, 1)]
    parallelize_gpt(chunks, [0, 1], topo, Parallelism(seed=3), torch.device("cpu"))
    draws = []
    for chunk in chunks:
        with chunk.tp_rng.fork():
            draws.append(torch.rand(64))
    return torch.equal(*draws)


def _eval_losses(topo, sp: bool) -> list[float]:
    """The evaluation loss of one batch by a fresh engine with dropout 0.1, and by one with dropout 0;
    then the first training step of the engine with dropout that evaluated."""
    g = torch.Generator().manual_seed(90)
    tokens = torch.randint(0, VOCAB, (2, 2, SEQ + 1), generator=g)
    batch = [{"tokens": t[:, :-1], "labels": t[:, 1:]} for t in tokens]
    evaluated = _engine(topo, sp)
    losses = [evaluated.eval_loss(batch), _engine(topo, sp, dropout=0.0).eval_loss(batch)]
    return [*losses, _step(evaluated, 0)]


def _world(rank, world_size, root):
    topo = Topology(RankGrid(tp=2, pp=1, dp=1))
    out = {sp: _case(topo, rank, f"{root}/sp{int(sp)}", sp) for sp in (False, True)}
    out["eval"] = {sp: _eval_losses(topo, sp) for sp in (False, True)}
    out["stage_tp_streams_agree"] = _stage_tp_streams_agree(topo)
    out["stages_share_masks"] = _stages_share_masks(Topology(RankGrid(tp=1, pp=2, dp=1)))
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_world(2, _world, str(tmp_path_factory.mktemp("dropout")))


@pytest.mark.parametrize("sp", [False, True])
def test_replicated_parameters_stay_identical_across_tensor_ranks(ranks, sp):
    for rank, report in enumerate(ranks):
        assert report[sp]["replicated_differ"] == [], rank


@pytest.mark.parametrize("sp", [False, True])
def test_resume_continues_with_exactly_the_same_losses(ranks, sp):
    for rank, report in enumerate(ranks):
        assert report[sp]["resumed"] == report[sp]["want"][SAVED_AT:], rank


@pytest.mark.parametrize("sp", [False, True])
def test_a_resume_at_another_zero_stage_keeps_the_generators(ranks, sp):
    """Only the ZeRO stage changed: each rank sits where it did, so it takes its generators from its
    own file, resharding the rest; they started afresh, and the resumed steps drew step 1's masks
    again (about 1% off the uninterrupted losses). (Planted: the generators taken only from an
    unchanged layout.)"""
    for rank, report in enumerate(ranks):
        torch.testing.assert_close(report[sp]["resumed_zero3"], report[sp]["want"][SAVED_AT:], rtol=1e-6, atol=0)


@pytest.mark.parametrize("sp", [False, True])
def test_the_comparison_depends_on_dropout_and_its_generators(ranks, sp):
    for report in ranks:
        assert report[sp]["without_rng"] != report[sp]["want"][SAVED_AT:]
        assert report[sp]["no_dropout"] != report[sp]["want"][0]


def test_pipeline_stages_draw_their_own_masks(ranks):
    """Planted by the one seed every pipeline rank had: the second stage's first blocks dropped
    exactly what the embedding and the first stage's blocks dropped."""
    for report in ranks:
        assert report["stages_share_masks"] == []


def test_pipeline_stages_get_their_own_tensor_parallel_stream(ranks):
    """The sharded regions' dropout (attention probabilities, a token chunk's residual branches) of a
    later stage must not repeat the first stage's. (Planted: every chunk's tensor-parallel stream
    seeded alike, whatever its stage.)"""
    for report in ranks:
        assert report["stage_tp_streams_agree"] is False


@pytest.mark.parametrize("sp", [False, True])
def test_evaluation_drops_nothing(ranks, sp):
    """An evaluation with dropout configured equals one of the same weights without: masks drawn there
    would make every evaluation loss noisy and higher. (Planted: ``eval_loss`` left the chunks in
    training mode.)"""
    for report in ranks:
        with_dropout, without, _ = report["eval"][sp]
        assert with_dropout == without


@pytest.mark.parametrize("sp", [False, True])
def test_training_after_an_evaluation_drops_again(ranks, sp):
    """An evaluation puts the chunks back in training mode: the step after it draws its dropout masks,
    and its loss is that of a first step taken without an evaluation before it."""
    for report in ranks:
        after_eval = report["eval"][sp][2]
        assert after_eval == report[sp]["want"][0] and after_eval != report[sp]["no_dropout"]


def test_the_cuda_generator_is_captured_and_put_back(monkeypatch):
    """The CUDA device's stream is one of those a checkpoint and a pipeline's rehearsal put back
    (``megazero.random_state``); without a GPU here, a stand-in for it records what is set. Planted:
    the CUDA state captured but never restored; or never captured."""
    from megazero.random_state import restore_rng, rng_state

    device = {"state": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *args: device["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, *args: device.update(state=state.clone()))
    saved = rng_state([])
    device["state"] = torch.tensor([9, 9, 9], dtype=torch.uint8)  # drawn from since
    restore_rng([], saved)
    assert device["state"].tolist() == [1, 2, 3]


def test_every_chunks_tensor_parallel_stream_is_put_back():
    """With virtual stages a rank holds several chunks, each drawing its sharded dropout from its own
    tensor-parallel stream (a chunk without tensor parallelism has none). (Planted: only the first
    chunk's stream put back, which no resume here covered: it needs tp, virtual stages and dropout.)"""
    from types import SimpleNamespace

    from megazero.random_state import restore_rng, rng_state
    from parallel.tensor_parallel.random import TensorParallelRNG

    chunks = [SimpleNamespace(tp_rng=TensorParallelRNG(3 + i, tp_rank=1)) for i in range(2)] + [SimpleNamespace()]
    saved = rng_state(chunks)
    for chunk in chunks[:2]:
        with chunk.tp_rng.fork():
            torch.rand(8)  # drawn from since
    restore_rng(chunks, saved)
    assert saved["tp"][2] is None
    assert [torch.equal(c.tp_rng.state, s) for c, s in zip(chunks[:2], saved["tp"])] == [True, True]


def test_a_rank_stays_in_place_when_only_the_zero_stage_changes():
    """``same_ranks`` decides whether a resumed rank takes its random generators from its own file: a
    layout that changed only its ZeRO stage leaves every rank at its coordinates (its generators are
    the uninterrupted run's); any other change, and a checkpoint a converter wrote, moves them.
    (Planted: the layout records compared whole, as before.)"""
    from megazero.config import resolve_config
    from megazero.engine import layout_record, same_ranks

    def cfg(*overrides):
        return resolve_config(load_config(None, ["--model.num_heads", "4", *overrides]), 4)

    saved = layout_record(cfg("--parallel.tp", "2", "--zero.stage", "1"))
    assert same_ranks(saved, cfg("--parallel.tp", "2", "--zero.stage", "3"))
    assert same_ranks(saved, cfg("--parallel.tp", "2", "--zero.stage", "1"))
    assert not same_ranks(saved, cfg("--parallel.tp", "4", "--zero.stage", "1"))
    assert not same_ranks(saved, cfg("--parallel.pp", "2", "--parallel.tp", "2", "--zero.stage", "1"))
    assert not same_ranks({**saved, "written_by": "megazero convert"}, cfg("--parallel.tp", "2", "--zero.stage", "1"))
