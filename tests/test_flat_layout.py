"""The flat layout's alignment, which the one-pass AdamW kernel relies on (``models/kernels/adamw.py``
moves 16 bytes at a time and rounds each parameter's run up to 64 elements, into the padding).

For random units of odd parameter sizes, every data-parallel size and bucket size: every rank's
slice of every bucket starts and ends on a multiple of 64 elements in its shard, so does every
segment's start, and a segment rounded up to 64 elements stays inside its slice and short of the
next segment. Runs without a GPU: the layout is arithmetic. Also which unit a parameter joins
under stage 3's persistence threshold (shapes only, on the meta device).
"""

import random

import pytest
import torch

from parallel.data_parallel.layout import FlatLayout
from parallel.data_parallel.wrapper import DataParallelSettings, flat_layout

ALIGN = 64


def _layouts():
    rng = random.Random(0)
    for dp in (1, 2, 3, 4, 8):
        for bucket_numel in (64, 1000, 4096, 1 << 20):
            units = [[rng.choice([1, 7, 63, 64, 65, 100, 2048, 3 * 2048 + 5, rng.randint(1, 50_000)])
                      for _ in range(rng.randint(1, 9))] for _ in range(rng.randint(1, 5))]
            for rank in range(dp):
                yield units, bucket_numel, dp, rank


@pytest.mark.parametrize("units, bucket_numel, dp, rank", list(_layouts()))
def test_every_slice_and_segment_is_aligned(units, bucket_numel, dp, rank):
    layout = FlatLayout(units, bucket_numel, dp, rank, align=ALIGN)
    for bucket in layout.buckets:
        lo, hi = layout.shard_range(bucket)
        assert lo % ALIGN == 0 and hi % ALIGN == 0, (bucket, lo, hi)
        segments = sorted(s.shard_offset for s in layout.segments if lo <= s.shard_offset < hi)
        ends = {s.shard_offset: s.shard_offset + s.numel for s in layout.segments if lo <= s.shard_offset < hi}
        for start, following in zip(segments, segments[1:] + [hi]):
            assert start % ALIGN == 0, (bucket, start)
            rounded = -(-ends[start] // ALIGN) * ALIGN
            assert rounded <= following, (bucket, start, ends[start], following)


CASES = sorted({(str(units), bucket_numel, dp): (units, bucket_numel, dp)
                for units, bucket_numel, dp, _ in _layouts()}.items())


@pytest.mark.parametrize("units, bucket_numel, dp", [c for _, c in CASES])
def test_every_parameter_element_is_owned_once_where_the_flat_space_puts_it(units, bucket_numel, dp):
    layouts = [FlatLayout(units, bucket_numel, dp, rank, align=ALIGN) for rank in range(dp)]
    first = layouts[0]
    for u, total in enumerate(first.unit_numel):  # buckets tile each unit, end to end, nothing past it
        starts = [(b.start, b.end) for b in first.unit_buckets(u)]
        assert starts[0][0] == 0 and starts[-1][1] == total
        assert all(end == nxt for (_, end), (nxt, _) in zip(starts, starts[1:]))
    assert first.shard_numel * dp == first.numel
    owner = [[None] * n for n in first.param_numel]
    for rank, layout in enumerate(layouts):
        for bucket in layout.buckets:  # rank r owns the r-th slice, as the reduce-scatter delivers
            size = bucket.numel // dp
            assert layout.owned_range(bucket) == (bucket.start + rank * size, bucket.start + (rank + 1) * size)
        taken = set()
        for seg in layout.segments:
            bucket = next(b for b in layout.buckets
                          if layout.shard_range(b)[0] <= seg.shard_offset < layout.shard_range(b)[1])
            lo = layout.owned_range(bucket)[0] + seg.shard_offset - bucket.shard_offset
            assert bucket.unit == layout.param_unit[seg.param]
            assert lo == layout.param_offset[seg.param] + seg.param_offset  # the same element, seen both ways
            assert seg.shard_offset + seg.numel <= layout.shard_range(bucket)[1] and seg.numel > 0
            here = set(range(seg.shard_offset, seg.shard_offset + seg.numel))
            assert not here & taken
            taken |= here
            for k in range(seg.param_offset, seg.param_offset + seg.numel):
                assert owner[seg.param][k] is None, (seg, k)
                owner[seg.param][k] = rank
    assert all(r is not None for elements in owner for r in elements)


@pytest.mark.parametrize("units, bucket_numel, dp", [c for _, c in CASES])
def test_a_parameter_lists_exactly_the_buckets_holding_its_elements(units, bucket_numel, dp):
    """The gradient reducer counts each parameter's elements into the buckets ``param_buckets`` names
    and launches a bucket's reduction when its count reaches ``bucket_param_numel``. A bucket that only
    touches a parameter's end (starting where it stops) would be counted zero elements once more,
    after it may have completed: its reduction would run twice, on a scratch buffer holding anything.
    A count above the bucket's real elements never completes, and the reduction waits for the step."""
    layout = FlatLayout(units, bucket_numel, dp, 0, align=ALIGN)
    real = [torch.zeros(n, dtype=torch.int64) for n in layout.unit_numel]  # 1 where a parameter element sits
    for p, numel in enumerate(layout.param_numel):
        lo, hi = layout.param_offset[p], layout.param_offset[p] + numel
        real[layout.param_unit[p]][lo:hi] = 1
        holding = [b for b in layout.unit_buckets(layout.param_unit[p]) if min(hi, b.end) > max(lo, b.start)]
        assert layout.param_buckets(p) == holding, (p, lo, hi)
    for bucket in layout.buckets:
        assert layout.bucket_param_numel(bucket) == int(real[bucket.unit][bucket.start:bucket.end].sum()), bucket


def test_persistence_threshold_keeps_only_smaller_parameters_whole():
    """``zero.persistence_threshold`` keeps parameters of *fewer* elements whole, in the persistent unit;
    one of exactly the threshold stays in its block's unit and is gathered with it. (Planted: ``>`` for
    ``>=`` moved every parameter of the threshold's size out of its block.)"""
    blocks = torch.nn.ModuleList(torch.nn.Linear(4, 6, device="meta") for _ in range(2))  # weights 24, biases 6
    settings = DataParallelSettings(stage=3, bucket_numel=64, persistence_threshold=24)
    params, unit_modules, layout = flat_layout([blocks], list(blocks), settings, dp=2, dp_rank=0)
    homes = {id(p): unit_modules[layout.param_unit[i]] for i, p in enumerate(params)}
    for block in blocks:
        assert homes[id(block.weight)] is block
        assert homes[id(block.bias)] is None


def _tile_table():
    """The one-pass AdamW kernel's table of tiles over a bucket's segments (its module imports Triton)."""
    pytest.importorskip("triton")
    from models.kernels.adamw import tile_table

    return tile_table


def test_adamw_tiles_cut_each_segment_from_its_start_with_its_decay():
    """Tiles of at most 1024 elements from each segment's start, the last one short, each with its
    segment's weight-decay flag. (Planted: every tile marked as decaying, which would decay biases
    and norm weights.)"""
    table = _tile_table()([(0, 2500, True), (2560, 10, False)], 2624, torch.device("cpu"))
    assert table.dtype == torch.int32
    assert table.tolist() == [[0, 1024, 1], [1024, 1024, 1], [2048, 452, 1], [2560, 10, 0]]


@pytest.mark.parametrize("segments, bucket_numel, words", [
    ([(0, 10, True), (96, 10, True)], 192, "segment at 96 of length 10"),  # starts inside a 64-element group
    ([(0, 70, True), (64, 10, True)], 128, "segment at 0 of length 70 is followed at 64"),  # into the next segment
    ([(0, 70, True), (128, 10, True)], 160, "segment at 128 of length 10 is followed at 160"),  # past the slice
    ([], 2**31, "int32 offsets"),
], ids=["misaligned start", "no padding before the next", "no padding before the end", "too large"])
def test_adamw_tiles_refuse_a_layout_the_kernel_cannot_run(segments, bucket_numel, words):
    """The kernel loads whole 64-element groups, rounding each segment's end up into the padding, and
    addresses the bucket with int32 offsets: a layout that breaks either is refused, not run over its
    neighbours. (Planted: the start's alignment not checked; each segment's end checked against the
    bucket's end instead of the next segment's start; the size not checked.)"""
    with pytest.raises(ValueError, match=words):
        _tile_table()(segments, bucket_numel, torch.device("cpu"))
