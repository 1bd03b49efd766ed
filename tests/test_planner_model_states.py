"""The planner's model-state bytes against what the sharded optimizer really allocates: a small GPT
built by the engine on two CPU ranks, for every ZeRO stage, dtype and gradient precision.

The planner counts unpadded parameters and the optimizer pads its flat buffers to the bucket and
shard sizes, so the two agree to within that padding (well under 1% here)."""

import pytest
import torch

from megazero.config import load_config, resolve_config
from megazero.planner.memory import model_state_bytes
from parallel.topology import RankGrid, Topology
from tests.distributed import run_world

DP = 2
CASES = [(dtype, accumulate, stage) for dtype in ("fp32", "bf16") for accumulate in (True, False)
         for stage in (0, 1, 2, 3)]


def small_config(dtype: str, accumulate_fp32: bool, stage: int):
    return resolve_config(load_config(None, [
        "--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_heads", "4", "--model.vocab_size", "500",
        "--model.seq_length", "32", "--precision.dtype", dtype, "--precision.accumulate_fp32",
        str(accumulate_fp32).lower(), "--zero.stage", str(stage), "--train.device", "cpu", "--train.compile", "false",
        "--train.micro_batch_size", "1", "--train.global_batch_size", str(DP)]), DP, DP)


def _allocated(rank, world_size):
    from megazero.engine import Engine

    topology = Topology(RankGrid(tp=1, pp=1, dp=world_size))
    return {case: sum(Engine(small_config(*case), topology, torch.device("cpu")).optimizer.memory_bytes().values())
            for case in CASES}


@pytest.fixture(scope="module")
def allocated():
    return run_world(DP, _allocated)[0]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-acc{int(c[1])}-zero{c[2]}")
def test_model_states_are_what_the_optimizer_allocates(allocated, case):
    """Planted: an fp32 run without accumulate_fp32 counted an fp32 copy of its gradient shard, which
    only 16-bit gradients need (20-25% too much)."""
    assert model_state_bytes(small_config(*case), 0) == pytest.approx(allocated[case], rel=0.01), case
