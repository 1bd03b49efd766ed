"""What a training checkpoint holds per rank, and how it is loaded into any layout.

Each rank writes one file: its optimizer's sharded state (``ShardedAdamW.sharded_state_dict``: the
ZeRO shard of the fp32 master weights and both Adam moments) and a description of every element in
it: the parameter's *logical* name (the single-device model's name; a tied head copy is named as
the embedding), which tensor-parallel slice of the logical tensor the rank holds, and where in that
slice each shard segment sits. The 16-bit weights are not
saved: they are the master rounded, and are rebuilt from it. Files hold only tensors and JSON
values (``serialization``): random-generator states are uint8 tensors, the segment table an int64
tensor, the parameter descriptions lists, the loss scaler and Adam step numbers.

Loading into the same layout reads the rank's own file (with its random-generator states, so the
run continues bit for bit). Loading into a different layout (tp, pp, dp, virtual stages or ZeRO
stage) reassembles each logical tensor the rank now needs from the segments of every old file and
cuts the new slices out of it: resharding of weights and optimizer state alike. Vocabulary rows
added or dropped by a different padding (the vocabulary is padded to 128·tp) are zero padding.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megazero.checkpoint.format import CheckpointError, FileIdentity, load_file, verify_file
from megazero.checkpoint.reader import CheckpointReader, index_file, rank_file
from megazero.optim import STATE_KEYS, ShardedAdamW
from megazero.random_state import restore_rng, rng_state
from models.embedding import fit_rows
from models.gpt import VOCAB_PADDED
from parallel.tensor_parallel.sharding import Shard


def rank_files(chunks, optimizer: ShardedAdamW, rank: int) -> dict:
    """Everything this rank writes into a checkpoint, by file name: its optimizer's sharded state with
    the random generators, and the state's description alone."""
    return {rank_file(rank): {**optimizer.sharded_state_dict(), "rng": rng_state(chunks)},
            index_file(rank): optimizer.describe()}


@dataclass(frozen=True)
class LoadPlan:
    """What ``load_checkpoint`` reads on this rank, decided and checked before anything is loaded."""

    files: list[str]  # checked (size and sha256) already
    exact: bool  # this rank's own file holds its shard laid out as it is now (``_exact``)
    # every file hashed while planning (``files``, the shard descriptions read), by name: the load
    # reads them unhashed only if it finds these very files (``format.open_checked``)
    checked: dict[str, FileIdentity]


def files_to_load(ckpt, rank: int, optimizer: ShardedAdamW, manifest: dict, same_ranks: bool,
                  group: Optional[dist.ProcessGroup] = None) -> LoadPlan:
    """The files ``load_checkpoint`` reads on this rank (its own, or those holding its tensors), each
    checked (size and sha256) here, before anything is loaded: the load, handed this plan, neither
    hashes them again nor reads the shard's description twice (an exact resume whose saved shard
    turns out padded otherwise falls back to resharding, whose files it checks as it reads).
    ``group``: the ranks loading together, which all stop on the first one's damaged file
    (``agreed_on_errors``)."""
    with agreed_on_errors(rank, group):
        return _plan(ckpt, rank, optimizer, manifest, same_ranks)


@contextlib.contextmanager
def agreed_on_errors(rank: int, group: Optional[dist.ProcessGroup]) -> Iterator[None]:
    """Run the block on every rank of the process ``group``, then agree on its outcome: where any rank
    met an error, every rank stops. A rank that stopped alone would leave its peers waiting, in the
    load's next collective or in this agreement's until the group's timeout (minutes), to fail there
    with a traceback each. The first such rank's error is the one named: a ``CheckpointError`` every
    rank raises, naming that rank; any other (a bug, a file that cannot be read) each rank that met
    it raises itself, with its traceback, and its peers raise a ``CheckpointError`` naming the rank
    and that error in one line. What they raise is ``agreed`` (``UserError``): rank 0 says it for
    all. A ``KeyboardInterrupt`` (Ctrl-C) is agreed on too: one that reached one rank alone would
    otherwise leave its peers waiting. ``group`` None: this rank alone,
    which raises its own."""
    error: Optional[BaseException] = None
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - agreed on below, then raised
        if group is None:
            raise
        error = exc
    if group is None:
        return
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, None if error is None else (rank, _one_line(error)), group=group)
    first = next((outcome for outcome in every if outcome is not None), None)
    if error is not None and not isinstance(error, CheckpointError):
        raise error
    if first is not None:
        raise CheckpointError(f"rank {first[0]}: {first[1]}", agreed=True)


def _one_line(error: BaseException) -> str:
    """``error`` as its peers name it: a ``CheckpointError``'s line as it is (it names its path), any
    other's type and message, on one line."""
    if isinstance(error, CheckpointError):
        return str(error)
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _plan(ckpt, rank: int, optimizer: ShardedAdamW, manifest: dict, same_ranks: bool) -> LoadPlan:
    """``files_to_load`` on this rank alone."""
    checked: dict[str, FileIdentity] = {}
    exact = _exact(ckpt, rank, optimizer, manifest, same_ranks, checked)
    if exact:
        names = [rank_file(rank)]
    else:
        reader = CheckpointReader(ckpt, manifest, checked=checked)
        held = set(reader.holders(name for name, _, _ in optimizer.local_tensors()))
        if same_ranks and rank_file(rank) in manifest["files"]:
            held.add(rank)  # its random generators
        names = [rank_file(r) for r in sorted(held)]
    for name in names:
        verify_file(Path(ckpt), name, manifest["files"][name], checked=checked)
    return LoadPlan(names, exact, checked)


def _exact(ckpt, rank: int, optimizer: ShardedAdamW, manifest: dict, same_ranks: bool,
           checked: dict[str, FileIdentity]) -> bool:
    """Whether this rank's own file holds its shard laid out as it is now (the exact resume)."""
    if not (same_ranks and rank_file(rank) in manifest["files"]):
        return False
    mine, saved = optimizer.describe(), _description(ckpt, rank, manifest, checked)
    return saved["params"] == mine["params"] and torch.equal(saved["segments"], mine["segments"])


def load_checkpoint(ckpt, rank: int, chunks, optimizer: ShardedAdamW, manifest: dict, same_ranks: bool,
                    plan: Optional[LoadPlan] = None, group: Optional[dist.ProcessGroup] = None) -> bool:
    """Load ``ckpt`` into this rank; returns True for an exact resume. ``same_ranks``: every rank sits at
    the coordinates it saved from (``engine.same_ranks``: the layout unchanged, the ZeRO stage aside),
    so this rank's own file holds its random generators, and may hold its shard as it is now. ``plan``: what
    ``files_to_load`` decided and checked (without one, the load decides, and checks as it reads).
    ``group``: the ranks loading together. A file replaced or rewritten under a rank's reads (since
    the plan hashed it, or during them) is met by that rank alone: the ranks agree on their reads
    (``agreed_on_errors``) before the parameters' all-gather that ends every rank's load, so each
    stops with that rank's one line instead of its peers waiting in that collective.

    The fast path reads only this rank's own file, random generators included, and is taken only
    when that file's shard description equals this rank's: a layout dict can match while the flat
    buckets differ (another bucket size, precision or persistence threshold), and copying shards
    then would scramble every parameter; and the shard's length must match too (a description does
    not record the padding after the last segment). Otherwise the checkpoint is resharded. At the
    same coordinates a resharded rank still takes its random generators from its own file: its
    tensor-group peers, which may have resumed exactly, must draw the same dropout masks as it does,
    and a resume that changed only the ZeRO stage draws the masks the uninterrupted run would.
    """
    with agreed_on_errors(rank, group):
        exact, rng = _read_into(ckpt, rank, optimizer, manifest, same_ranks, plan)
    optimizer.publish_loaded()
    if rng is not None:
        restore_rng(chunks, rng)
    return exact


def _read_into(ckpt, rank: int, optimizer: ShardedAdamW, manifest: dict, same_ranks: bool,
               plan: Optional[LoadPlan]) -> tuple[bool, Optional[dict]]:
    """Every read of ``load_checkpoint``, the optimizer's shard filled and not yet published; returns
    whether the load was exact and the random generators' states to restore (None: none saved for
    this rank)."""
    own_file = same_ranks and rank_file(rank) in manifest["files"]
    checked = dict(plan.checked) if plan is not None else {}  # each file is hashed once in all
    exact = plan.exact if plan is not None else _exact(ckpt, rank, optimizer, manifest, same_ranks, checked)
    if exact:
        state = checked_entries(Path(ckpt) / rank_file(rank), load_file(ckpt, rank_file(rank), manifest=manifest,
                                                                         checked=checked), RANK_ENTRIES)
        if state["master"].numel() == optimizer.master.numel():  # the padding may differ (older layouts)
            optimizer.load_sharded_state_dict(state)
            return True, state["rng"]
    # an exact resume falling back here reads files ``files_to_load`` did not name: those are hashed
    reader = CheckpointReader(ckpt, manifest, checked=checked)
    load_resharded(reader, optimizer)
    return False, _values(reader, rank, "rng") if own_file else None


RANK_ENTRIES = {**{key: torch.Tensor for key in STATE_KEYS}, "params": list, "segments": torch.Tensor,
                "adam_step": (int, float), "scaler": dict, "rng": dict}
"""A rank file's entries and what each is: a file whose record checks out (sealed again by hand, or
written by another tool) with an entry missing or of another type stopped a resume with a KeyError
or a TypeError from deep in the load."""


def checked_entries(path: Path, values: dict, keys) -> dict:
    """``values`` (a rank file's entries) once each of ``keys`` is there and of its type."""
    for key in keys:
        if key not in values:
            raise CheckpointError(f"{path}: holds no entry {key!r}; it was not written by this version of megazero")
        value = values[key]
        if not isinstance(value, RANK_ENTRIES[key]) or isinstance(value, bool):
            raise CheckpointError(f"{path}: its entry {key!r} is a {type(value).__name__}, which megazero never "
                                  "writes there; restore the file, or load an earlier checkpoint")
    return values


def _values(reader: CheckpointReader, rank: int, key: str):
    """One entry of a rank file, read alone and checked (``checked_entries``)."""
    return checked_entries(reader.ckpt / rank_file(rank), reader.values(rank, (key,)), (key,))[key]


def _description(ckpt, rank: int, manifest: dict, checked: dict[str, FileIdentity]) -> dict:
    name = index_file(rank) if index_file(rank) in manifest["files"] else rank_file(rank)
    return load_file(ckpt, name, manifest=manifest, checked=checked)


def load_resharded(reader: CheckpointReader, optimizer: ShardedAdamW) -> None:
    """Any other layout: rebuild each logical tensor this rank needs, one at a time, and take the new
    slice of it. Only the rank files holding such a tensor are opened (a pipeline stage reads its own
    stage's files, not the whole checkpoint). The shard is left unpublished (``load_checkpoint``
    publishes it once every rank's reads succeeded)."""
    ckpt = reader.ckpt
    wanted = optimizer.local_tensors()
    holders = reader.holders(name for name, _, _ in wanted)
    if not holders:
        raise CheckpointError(f"{ckpt}: holds no parameter of this rank's model part; was it saved from a "
                              "different model?")
    # A rank whose shard was all padding saved step 0: take the largest.
    adam_step = max(_values(reader, r, "adam_step") for r in holders)
    scaler = _values(reader, holders[0], "scaler")

    def local_values():
        for name, shape, shard in wanted:
            full = reader.read(name, STATE_KEYS)
            yield {key: fit_to_shard(full[key], shard, shape, name, ckpt) for key in STATE_KEYS}
    optimizer.load_local_state(local_values(), adam_step, scaler)


def load_full_weights(ckpt, manifest: Optional[dict] = None) -> dict[str, torch.Tensor]:
    """Every logical parameter's fp32 master value, whole (for a single-process model or export).
    ``manifest``: the record the caller read already, which the files must then match."""
    reader = CheckpointReader(ckpt, manifest)
    return dict((name, value["master"]) for name, value in reader.read_many(reader.shapes))


def fit_to_shard(full: torch.Tensor, shard: Optional[Shard], shape: tuple, name: str, ckpt) -> torch.Tensor:
    """This rank's slice of a logical tensor; the vocabulary-padded matrices may gain or lose padding
    rows (the vocabulary is padded to 128·tp), any other shape change is an error."""
    target = list(shape)
    if shard is not None:
        target[shard.dim] *= shard.count
    if list(full.shape) != target:
        if name not in VOCAB_PADDED or list(full.shape[1:]) != target[1:]:
            raise CheckpointError(f"{ckpt}: parameter {name!r} has shape {tuple(full.shape)} in the checkpoint "
                                  f"but {tuple(target)} in this model; the model config differs")
        full = fit_rows(full, target[0])
    return full if shard is None else shard.take(full)
