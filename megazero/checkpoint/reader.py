"""Reading a checkpoint of any layout one logical parameter at a time.

A training checkpoint is written per rank (see ``state``): each rank file holds flat shards of the
fp32 master and both Adam moments, and a small index file says what the shard is -- for each
parameter its logical (single-device) name, its local shape, the tensor-parallel slice it is, and
the segments placing its elements in the flat shard. This module turns that back into logical
tensors without ever loading the model:

* ``CheckpointReader(ckpt)`` reads the index files only (a few KiB a rank) and knows every
  logical parameter's full shape and which rank files hold which of its elements (``holders``).
* ``read(name, keys)`` assembles one logical tensor (its master, or the moments too) from every
  tp slice and ZeRO segment, reading just those byte ranges from the rank files with plain reads
  (``serialization.RangeFile``: no memory map, which a host refuses for a file larger than its
  RAM), so host memory stays near one logical tensor whatever the size of the model or the files.

Checksums: a rank file is verified against ``COMPLETE`` (size, then sha256, as ``format.load_file``
does) the first time any of its bytes are needed, before they are used, through the descriptor its
first ranges are read from. Hashing streams the file, so the check costs one extra sequential read
and no memory; a file the conversion does not need is not read at all. Each later opening (one per
logical tensor) must find the very file that was hashed, unchanged after its reads too
(``format.open_checked``, ``format.confirm_unchanged``): a checkpoint replaced while it is read is
refused, not mixed into the one checked. The check catches damage, not forgery, as in ``format``.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from megazero.checkpoint import serialization
from megazero.checkpoint.format import (
    CheckpointError, FileIdentity, confirm_unchanged, load_file, open_checked, read_manifest,
)
from megazero.optim import STATE_KEYS  # the flat per-rank tensors holding parameter elements
from parallel.tensor_parallel.sharding import Shard



def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def index_file(rank: int) -> str:
    """A rank file's shard description alone: small, so a reader can find the files it needs."""
    return f"rank_{rank:05d}.index.safetensors"


@dataclass(frozen=True)
class Piece:
    """Elements of one tp slice of a logical parameter held in one rank file: ``segments`` are
    (offset in the flat local slice, offset in the rank's flat shard, count)."""

    rank: int
    shard: Optional[Shard]
    local_shape: tuple[int, ...]
    segments: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class RankIndex:
    """What one rank file holds: its parameters (logical name, local shape, tp slice) and segments
    (param index, offset in the parameter, offset in the shard, count), as the rank described them."""

    params: list[tuple[str, tuple[int, ...], Optional[Shard]]]
    segments: list[tuple[int, int, int, int]]



class CheckpointReader:
    """A complete checkpoint directory, readable by logical parameter (see the module docstring).

    ``checked``: the identities of files of ``ckpt`` hashed already (a load's plan), which are read
    unhashed if they are still those files; the files this reader hashes are added to it. Without
    ``verify``, a file not in it is checked for its size alone."""

    def __init__(self, ckpt, manifest: Optional[dict] = None, verify: bool = True,
                 checked: Optional[dict[str, FileIdentity]] = None):
        self.ckpt = Path(ckpt)
        self.manifest = manifest if manifest is not None else read_manifest(self.ckpt)
        self.verify = verify
        self.checked = {} if checked is None else checked
        self.world_size = int(self.manifest["world_size"])
        self.ranks = [self._rank_index(r) for r in range(self.world_size)]
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.pieces: dict[str, list[Piece]] = {}
        for r, index in enumerate(self.ranks):
            by_param: dict[int, list] = {}
            for param, param_offset, shard_offset, numel in index.segments:
                by_param.setdefault(param, []).append((param_offset, shard_offset, numel))
            for param, (name, local_shape, shard) in enumerate(index.params):
                full = shard.full_shape(local_shape) if shard is not None else tuple(local_shape)
                if self.shapes.setdefault(name, full) != full:
                    raise CheckpointError(f"{self.ckpt / index_file(r)}: parameter {name!r} is {full} here but "
                                          f"{self.shapes[name]} in another rank's file; the checkpoint is damaged")
                if by_param.get(param):
                    self.pieces.setdefault(name, []).append(Piece(r, shard, tuple(local_shape),
                                                                  tuple(by_param[param])))

    @property
    def meta(self) -> dict:
        """What the run recorded with the checkpoint (step, consumed samples, layout, config)."""
        return self.manifest.get("meta") or {}

    def holders(self, names: Iterable[str]) -> list[int]:
        """The ranks whose files hold any element of ``names``: all a loader needs to open."""
        wanted = set(names)
        return sorted({p.rank for name in wanted for p in self.pieces.get(name, ())})

    # --- the index ---------------------------------------------------------------------------
    def _rank_index(self, rank: int) -> RankIndex:
        name = index_file(rank) if index_file(rank) in self.manifest["files"] else rank_file(rank)
        if name == rank_file(rank):  # a checkpoint without index files: the description is in the rank file
            described = self.values(rank, ("params", "segments"))
        else:
            described = load_file(self.ckpt, name, manifest=self.manifest, verify=self.verify, checked=self.checked)
        try:
            params = [(str(n), tuple(int(d) for d in shape), None if s is None else Shard(*(int(v) for v in s)))
                      for n, shape, s in described["params"]]
            segments = [tuple(int(v) for v in row) for row in described["segments"].reshape(-1, 4).tolist()]
            for param, param_offset, _, numel in segments:  # a segment past its parameter fills no element
                if not (0 <= param < len(params) and 0 <= param_offset and 0 <= numel
                        and param_offset + numel <= math.prod(params[param][1])):
                    raise ValueError(f"segment {param, param_offset, numel} lies outside its parameter")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{self.ckpt / name}: its shard description is damaged ({e}); restore the file "
                                  "or load an earlier checkpoint") from None
        return RankIndex(params, segments)

    # --- reading -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _open(self, rank: int) -> Iterator[serialization.RangeFile]:
        """A rank file for range reads, checked through the descriptor they read (hashed at its first
        opening, the same file at every later one) and, once they are done, still unchanged."""
        name = rank_file(rank)
        entry = self.manifest["files"].get(name)
        if entry is None:
            raise CheckpointError(f"{self.ckpt}: {name} is not listed in {self.ckpt / 'COMPLETE'}; the checkpoint is "
                                  "damaged -- load an earlier one")
        with open_checked(self.ckpt, name, entry, self.checked, sha256=self.verify) as f:
            try:
                yield serialization.RangeFile(f)
            except serialization.FileFormatError as e:
                confirm_unchanged(f, self.ckpt / name, self.checked.get(name))  # changed under the reads: not damage
                raise CheckpointError(f"{self.ckpt / name}: {e}; restore it or load an earlier checkpoint") from None
            confirm_unchanged(f, self.ckpt / name, self.checked.get(name))

    def values(self, rank: int, keys: Iterable[str]) -> dict[str, Any]:
        """Top-level entries ``keys`` of a rank file (``adam_step``, ``scaler``, ``rng``, ...), with only
        the tensors inside them read."""
        path = self.ckpt / rank_file(rank)
        with self._open(rank) as f:
            try:
                tree = json.loads(f.metadata.get(serialization.TREE, "null"))
            except (ValueError, RecursionError) as e:  # as ``serialization.read`` says it
                raise CheckpointError(f"{path}: its {serialization.TREE!r} metadata is damaged ({e}); restore it or "
                                      "load an earlier checkpoint") from None
            if not isinstance(tree, dict):
                raise CheckpointError(f"{path}: a safetensors file without megazero's metadata; restore it or "
                                      "load an earlier checkpoint")
            lazy = _LazyTensors(f)
            try:
                return {key: serialization.join(tree[key], lazy) for key in keys}
            except KeyError as e:
                raise CheckpointError(f"{path}: holds no entry {e}; it was not written by this version of "
                                      "megazero") from None

    def read(self, name: str, keys: Iterable[str] = ("master",)) -> dict[str, torch.Tensor]:
        """One logical parameter, whole (fp32, full shape as saved: vocabulary padding included),
        for each of ``keys`` (a subset of ``STATE_KEYS``)."""
        return next(iter(self.read_many([name], keys)))[1]

    def read_many(self, names: Iterable[str], keys: Iterable[str] = ("master",)
                  ) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """(name, {key: logical tensor}) for each of ``names`` in turn; only one is held at a time."""
        keys = tuple(keys)
        for key in keys:
            if key not in STATE_KEYS:
                raise ValueError(f"key {key!r}: a checkpoint holds {', '.join(STATE_KEYS)} per element")
        for name in names:
            if name not in self.shapes:
                raise CheckpointError(f"{self.ckpt}: has no parameter {name!r}; was it saved from a different model?")
            yield name, self._assemble(name, keys)

    def _assemble(self, name: str, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
        full = {key: torch.empty(self.shapes[name], dtype=torch.float32) for key in keys}
        slices: dict[int, list[Piece]] = {}
        for piece in self.pieces.get(name, ()):
            slices.setdefault(0 if piece.shard is None else piece.shard.index, []).append(piece)
        first = next(iter(slices.values()), [None])[0]
        count = 1 if first is None or first.shard is None else first.shard.count
        if sorted(slices) != list(range(count)):
            raise CheckpointError(f"{self.ckpt}: parameter {name!r} has tp slices {sorted(slices)} of {count}; "
                                  "the checkpoint is incomplete -- load another one")
        for index, pieces in sorted(slices.items()):
            shard, local_shape = pieces[0].shard, pieces[0].local_shape
            local = {key: torch.empty(math.prod(local_shape), dtype=torch.float32) for key in keys}
            reads = _cover(pieces, math.prod(local_shape))
            if reads is None:
                raise CheckpointError(f"{self.ckpt}: the rank files hold only part of parameter {name!r} (tp slice "
                                      f"{index}); the checkpoint is incomplete -- load another one")
            for rank, segments in reads.items():
                with self._open(rank) as f:
                    for key in keys:
                        for param_offset, shard_offset, numel in segments:
                            local[key][param_offset:param_offset + numel] = f.read(key, shard_offset, numel)
            for key in keys:
                block = local[key].view(local_shape)
                target = full[key] if shard is None else full[key].narrow(
                    shard.dim, shard.index * local_shape[shard.dim], local_shape[shard.dim])
                target.copy_(block)
        return full


class _LazyTensors(Mapping):
    """The tensors of an open safetensors file, read only when ``serialization.join`` asks for one."""

    def __init__(self, f):
        self.f, self.names = f, set(f.keys())

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.f.read(name)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _cover(pieces: list[Piece], numel: int) -> Optional[dict[int, list[tuple[int, int, int]]]]:
    """The segments to read, by rank, so each element of a ``numel``-element slice is read once, or
    None if the pieces leave an element uncovered. Copies of the same elements (a tied head's copy
    on the last pipeline stage, replicated shards) are read from the first rank holding them."""
    candidates = sorted((offset, n, shard_offset, p.rank) for p in pieces for offset, shard_offset, n in p.segments)
    reads: dict[int, list] = {}
    covered = 0  # every element before this one is read
    for offset, n, shard_offset, rank in candidates:
        if offset > covered:
            return None
        if offset + n <= covered:
            continue
        skip = covered - offset  # a segment overlapping what is read: read its new tail only
        reads.setdefault(rank, []).append((covered, shard_offset + skip, n - skip))
        covered = offset + n
    return reads if covered >= numel else None
