"""Fixtures shared by several test modules."""

import os

import pytest
import torch
import torch.distributed as dist

# Inductor compiles a graph's kernels in a pool of worker processes, one pool in each process that
# compiles; with the ranks of a test world on CI's two cores, starting a pool in every rank cost more
# than it saved (the zero-bubble world's first compiled case: 52 s with pools, 46 s without, cold).
# Ranks inherit the environment, and inductor reads it when first imported, after this. GPU machines
# keep their pools: their kernels compile with Triton, and the cores are many.
if not torch.cuda.is_available():
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A gloo world of one in this process, for code that needs a process group but no peers."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg')}/store", rank=0,
                            world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
