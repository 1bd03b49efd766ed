"""Fixtures shared by several test modules."""

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A gloo world of one in this process, for code that needs a process group but no peers."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg')}/store", rank=0,
                            world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
