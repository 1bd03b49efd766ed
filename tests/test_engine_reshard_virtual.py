"""A checkpoint resharded across virtual pipeline stages continues the same run, on 2 gloo ranks (pp 2).

A run saved under plain 1F1B (one chunk of two blocks a rank) is loaded into the interleaved
schedule (two chunks of one block a rank: each rank now holds other blocks) and the other way
round; and into a split that cuts block 1 in half (``[1.5, 2.5]``: its attention on rank 0, its MLP
on rank 1) and back; and between the interleaved placement and ZB-V's (rank 0 then holds blocks 0 and
3, the embedding and both copies of the tied head) and from ZB-V to 1F1B. The loader must rebuild each block's weights and Adam moments from whichever rank's file
holds them; the next steps' losses then equal those of the run that was never stopped (to 1e-6
relative: the two schedules sum the same micro-batches in another order).

Planted bug this caught: the same-layout fast path taken whenever a rank's own file exists, without
comparing shard descriptions (the shards have the same size, so each rank loads other blocks).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megazero.checkpoint import CheckpointWriter, read_manifest, step_dir_name
from megazero.checkpoint.state import load_checkpoint, rank_files
from megazero.config import load_config
from megazero.engine import Engine
from parallel.topology import RankGrid, Topology
from tests.distributed import run_world

SAVED_AT, STEPS, VOCAB, SEQ = 2, 4, 61, 16
PAIRS = [("1f1b", "interleaved"), ("interleaved", "1f1b"), ("1f1b", "half block"), ("half block", "1f1b"),
         ("interleaved", "zb-v"), ("zb-v", "1f1b")]


LAYOUTS = {"1f1b": (), "interleaved": ("--parallel.virtual_stages", "2"),
           "half block": ("--parallel.pipeline_split", "[1.5, 2.5]"),
           "zb-v": ("--parallel.virtual_stages", "2", "--parallel.pipeline_schedule", "zb-v")}


def _engine(topo, layout: str) -> Engine:
    cfg = load_config(None, ["--model.num_layers", "4", "--model.hidden_size", "32", "--model.num_heads", "4",
                             "--model.vocab_size", str(VOCAB), "--model.seq_length", str(SEQ),
                             "--parallel.pp", "2", *LAYOUTS[layout],
                             "--zero.stage", "1", "--train.micro_batch_size", "2", "--train.global_batch_size", "8",
                             "--train.device", "cpu", "--optimizer.lr", "1e-2"])
    return Engine(cfg, topo, torch.device("cpu"))


def _step(engine, step: int) -> float:
    g = torch.Generator().manual_seed(70 + step)
    tokens = torch.randint(0, VOCAB, (4, 2, SEQ + 1), generator=g)
    return engine.train_step([{"tokens": t[:, :-1], "labels": t[:, 1:]} for t in tokens]).loss


def _case(topo, rank, root, source_layout: str, target_layout: str) -> dict:
    source = _engine(topo, source_layout)
    want = [_step(source, step) for step in range(SAVED_AT)]
    writer = CheckpointWriter(root, rank=rank, world_size=2, barrier=dist.barrier)
    writer.save(SAVED_AT, rank_files(source.chunks, source.optimizer, rank), meta={"step": SAVED_AT})
    want += [_step(source, step) for step in range(SAVED_AT, STEPS)]
    ckpt = f"{root}/{step_dir_name(SAVED_AT)}"
    target = _engine(topo, target_layout)
    exact = load_checkpoint(ckpt, rank, target.chunks, target.optimizer, read_manifest(ckpt), same_ranks=True)
    got = [_step(target, step) for step in range(SAVED_AT, STEPS)]
    return {"exact": exact, "want": want[SAVED_AT:], "got": got}


def _world(rank, world_size, root):
    topo = Topology(RankGrid(tp=1, pp=2, dp=1))
    return {(s, t): _case(topo, rank, f"{root}/{s}-{t}", s, t) for s, t in PAIRS}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_world(2, _world, str(tmp_path_factory.mktemp("virtual")))


@pytest.mark.parametrize("source, target", PAIRS)
def test_resharded_run_continues_with_the_same_losses(ranks, source, target):
    for rank, report in enumerate(ranks):
        case = report[(source, target)]
        assert not case["exact"], "the ranks hold other blocks or parts of blocks: the loader must reshard"
        assert case["got"] == pytest.approx(case["want"], rel=1e-6), rank
