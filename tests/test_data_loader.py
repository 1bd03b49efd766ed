"""Loader: for dp 1, 2 and 4 the ranks of a global batch together read exactly that batch, and a
run resumed at consumed samples k reads exactly the tail of the uninterrupted run. dp=2 also runs
on two real gloo processes that gather what they read and compare it with one process."""

from __future__ import annotations

from itertools import islice

import numpy as np
import pytest
import torch

from data_pipeline.gpt_samples import GPTSamples
from data_pipeline.indexed import IndexedDataset, IndexedDatasetWriter
from data_pipeline.loader import global_batch, iterate_global_batches, micro_batch_indices, to_batch
from tests.distributed import run_world

SEQ, GLOBAL, MICRO = 6, 8, 2


def write_data(directory):
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(f"{directory}/d", np.uint16) as w:
        for _ in range(60):
            w.add_document(rng.integers(0, 500, size=int(rng.integers(1, 20))))


def open_samples(directory):
    return GPTSamples(IndexedDataset(f"{directory}/d"), SEQ, 64, 7, cache_dir=f"{directory}/cache")


def make_samples(directory):
    write_data(directory)
    return open_samples(directory)


def run_tokens(samples, consumed, dp_rank, dp_size, steps):
    """Per step: this rank's micro-batches as token lists."""
    batches = islice(iterate_global_batches(samples, consumed, GLOBAL, MICRO, dp_rank, dp_size), steps)
    return [[m["tokens"].tolist() for m in micro] for _, micro in batches]


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    return make_samples(str(tmp_path_factory.mktemp("loader")))


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_ranks_partition_each_global_batch(dp):
    for consumed in (0, 8, 40):
        idx = np.concatenate([i for r in range(dp) for i in micro_batch_indices(consumed, GLOBAL, MICRO, r, dp)])
        assert sorted(idx.tolist()) == list(range(consumed, consumed + GLOBAL))



def test_each_micro_batch_step_reads_the_next_samples_across_the_ranks():
    """Megatron's layout: micro-batch step m of the group reads the micro x dp samples that follow, rank
    r the r-th micro of them, so every step of the accumulation takes consecutive samples of the global
    order. (Planted: each rank given a contiguous quarter of the global batch, which every partition
    and resume check still passed.)"""
    got = [[i.tolist() for i in micro_batch_indices(16, 16, 2, r, 4)] for r in range(4)]
    assert got == [[[16, 17], [24, 25]], [[18, 19], [26, 27]], [[20, 21], [28, 29]], [[22, 23], [30, 31]]]


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("k", [8, 24, 48])
def test_resume_equals_uninterrupted_tail(samples, dp, k):
    for rank in range(dp):
        full = run_tokens(samples, 0, rank, dp, steps=len(samples) // GLOBAL)
        resumed = run_tokens(samples, k, rank, dp, steps=len(samples) // GLOBAL)
        assert resumed == full[k // GLOBAL:]
        assert len(resumed) > 0


def test_batches_are_shifted_tokens_and_labels(samples):
    (batch,) = global_batch(samples, 0, MICRO, MICRO, 0, 1)
    raw = np.stack([samples[0], samples[1]])
    assert batch["tokens"].dtype == torch.int64 and batch["tokens"].shape == (MICRO, SEQ)
    assert batch["tokens"].tolist() == raw[:, :-1].tolist()
    assert batch["labels"].tolist() == raw[:, 1:].tolist()


def test_same_samples_whatever_the_dp_size(samples):
    """Every dp size reads the same multiset of samples in each global batch."""
    def batch_samples(dp, consumed):
        return sorted(s.tolist() for r in range(dp) for m in global_batch(samples, consumed, GLOBAL, MICRO, r, dp)
                      for s in m["tokens"])
    for consumed in (0, 16):
        assert batch_samples(1, consumed) == batch_samples(2, consumed) == batch_samples(4, consumed)


def test_bad_layouts_and_exhaustion(samples):
    with pytest.raises(ValueError, match="multiple of micro batch x dp"):
        micro_batch_indices(0, 10, 2, 0, 4)
    with pytest.raises(ValueError, match="outside a data-parallel group"):
        micro_batch_indices(0, 8, 2, 2, 2)
    # a negative rank would read the samples of the rank below 0; a micro-batch of 0 divides by zero
    # (planted: each check dropped, both passed)
    with pytest.raises(ValueError, match="dp_rank -1 is outside a data-parallel group of 2"):
        micro_batch_indices(0, 8, 2, -1, 2)
    with pytest.raises(ValueError, match="global batch 8 must be a positive multiple of micro batch x dp = 0 x 1"):
        micro_batch_indices(0, 8, 0, 0, 1)
    with pytest.raises(ValueError, match="build it for more samples"):
        global_batch(samples, len(samples) - 4, GLOBAL, MICRO, 0, 1)
    with pytest.raises(ValueError):
        to_batch([])


def test_the_last_whole_batch_of_the_dataset_is_served():
    """A blend holds exactly the samples the run asked for (train steps x global batch), so its last
    step reads the dataset's last sample. (Planted: ``>=`` for ``>`` refusing that step, or ``<`` for
    ``<=`` ending the iteration one batch early.)"""
    dataset = [np.full(SEQ + 1, i) for i in range(3 * GLOBAL)]
    last = global_batch(dataset, 2 * GLOBAL, GLOBAL, MICRO, 0, 1)
    assert [m["tokens"][:, 0].tolist() for m in last][-1] == [len(dataset) - 2, len(dataset) - 1]
    assert [consumed for consumed, _ in iterate_global_batches(dataset, 0, GLOBAL, MICRO, 0, 1)] == \
        [GLOBAL, 2 * GLOBAL, 3 * GLOBAL]


def _gloo_ranks(rank, world_size, directory, k):
    import torch.distributed as dist

    samples = open_samples(directory)  # both ranks at once: the file lock lets one build, the other load
    out = {}
    for consumed in (0, k):
        steps = []
        for _, micro in iterate_global_batches(samples, consumed, GLOBAL, MICRO, rank, world_size):
            mine = torch.cat([m["tokens"] for m in micro])
            gathered = [torch.empty_like(mine) for _ in range(world_size)]
            dist.all_gather(gathered, mine)
            steps.append(sorted(row.tolist() for g in gathered for row in g))
        out[consumed] = steps
    return out


def test_two_gloo_ranks_read_the_single_process_batches(tmp_path):
    k = 16
    write_data(str(tmp_path))
    results = run_world(2, _gloo_ranks, str(tmp_path), k)
    single = open_samples(str(tmp_path))
    expected = [sorted(s.tolist() for m in micro for s in m["tokens"])
                for _, micro in iterate_global_batches(single, 0, GLOBAL, MICRO, 0, 1)]
    for rank_result in results:
        assert rank_result[0] == expected
        assert rank_result[k] == expected[k // GLOBAL:]
