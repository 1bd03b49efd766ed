"""Where every parameter element lives in ZeRO's flat buffers, and which rank owns it.

Parameters are grouped into *units* (a transformer block, or everything outside the blocks); each
unit's parameters are laid end to end in one flat index space, each start aligned, and the space
is cut into constant-size *buckets* (ZeRO-R's fixed communication buffers: the same size whatever
the model). Every bucket is padded to a multiple of the data-parallel size times the alignment and
split evenly, so rank r owns the r-th slice of every bucket, aligned like the parameters. A rank's
*shard* is its owned slices of all buckets, concatenated: the fp32 master weights, Adam moments and
reduced gradients live in that space.

Keeping this arithmetic apart from the tensors lets the memory model and the tests reason about
a layout without allocating anything.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bucket:
    unit: int
    start: int  # first element in the unit's flat space
    numel: int  # multiple of dp x align
    shard_offset: int  # where this bucket's owned slice starts in the rank's shard

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class Segment:
    """The part of one parameter that falls in this rank's shard."""

    param: int
    param_offset: int  # first element within the flattened parameter
    shard_offset: int  # where it sits in the rank's shard
    numel: int


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class FlatLayout:
    """Offsets, buckets and owned segments for ``units`` (lists of parameter element counts)."""

    def __init__(self, units: list[list[int]], bucket_numel: int, dp: int, dp_rank: int, align: int = 64):
        self.dp, self.dp_rank = dp, dp_rank
        self.bucket_numel = _round_up(max(bucket_numel, dp * align), dp * align)
        self.param_unit: list[int] = []
        self.param_offset: list[int] = []  # start within its unit's flat space
        self.param_numel: list[int] = []
        self.unit_numel: list[int] = []
        self.unit_params: list[list[int]] = []
        for u, numels in enumerate(units):
            offset, members = 0, []
            for n in numels:
                members.append(len(self.param_numel))
                self.param_unit.append(u)
                self.param_offset.append(offset)
                self.param_numel.append(n)
                offset = _round_up(offset + n, align)
            self.unit_params.append(members)
            # A multiple of dp * align, as the buckets are: every rank's slice of every bucket then
            # starts and ends aligned, so kernels over the shard can move 16 bytes at a time.
            self.unit_numel.append(_round_up(max(offset, 1), dp * align))
        self.buckets: list[Bucket] = []
        shard = 0
        for u, total in enumerate(self.unit_numel):
            for start in range(0, total, self.bucket_numel):
                numel = min(self.bucket_numel, total - start)
                self.buckets.append(Bucket(u, start, numel, shard))
                shard += numel // dp
        self.shard_numel = shard
        self.segments = self._owned_segments()

    @property
    def numel(self) -> int:
        """Elements in all units, padding included (what a full replica holds)."""
        return sum(self.unit_numel)

    def owned_range(self, bucket: Bucket) -> tuple[int, int]:
        """This rank's slice of ``bucket`` in the unit's flat space."""
        size = bucket.numel // self.dp
        start = bucket.start + self.dp_rank * size
        return start, start + size

    def shard_range(self, bucket: Bucket) -> tuple[int, int]:
        """Where this rank's slice of ``bucket`` sits in its shard (master, moments, reduced gradients)."""
        return bucket.shard_offset, bucket.shard_offset + bucket.numel // self.dp

    def unit_buckets(self, unit: int) -> list[Bucket]:
        return [b for b in self.buckets if b.unit == unit]

    def param_buckets(self, param: int) -> list[Bucket]:
        lo = self.param_offset[param]
        hi = lo + self.param_numel[param]
        return [b for b in self.unit_buckets(self.param_unit[param]) if b.start < hi and lo < b.end]

    def bucket_param_numel(self, bucket: Bucket) -> int:
        """Real (non-padding) parameter elements in ``bucket``: how many gradients complete it."""
        total = 0
        for p in self.unit_params[bucket.unit]:
            lo = self.param_offset[p]
            hi = lo + self.param_numel[p]
            total += max(0, min(hi, bucket.end) - max(lo, bucket.start))
        return total

    def _owned_segments(self) -> list[Segment]:
        segments = []
        for bucket in self.buckets:
            own_lo, own_hi = self.owned_range(bucket)
            for p in self.unit_params[bucket.unit]:
                lo = max(self.param_offset[p], own_lo)
                hi = min(self.param_offset[p] + self.param_numel[p], own_hi)
                if lo < hi:
                    segments.append(Segment(p, lo - self.param_offset[p],
                                            bucket.shard_offset + lo - own_lo, hi - lo))
        return segments
