"""What a training checkpoint holds per rank, and how it is loaded into any layout.

Each rank writes one file: its ZeRO shard of the fp32 master weights and both Adam moments, plus a
description of every element in it — the parameter's *logical* name (the single-device model's
name; a tied head copy is named as the embedding), which tensor-parallel slice of the logical
tensor the rank holds, and where in that slice each shard segment sits. The 16-bit weights are not
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

from typing import Optional

import torch

from megazero.checkpoint.format import CheckpointError, load_file, read_manifest
from megazero.zero import ZeroOptimizer
from parallel.tensor_parallel.sharding import Shard, param_shards

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def index_file(rank: int) -> str:
    """A rank file's shard description alone: small, so a loader can find the files it needs."""
    return f"rank_{rank:05d}.index.safetensors"


def rank_files(chunks, optimizer: ZeroOptimizer, rank: int) -> dict:
    """Everything this rank writes into a checkpoint, by file name."""
    return {rank_file(rank): rank_state(chunks, optimizer), index_file(rank): describe_shard(chunks, optimizer)}


def logical_names(chunks: list[torch.nn.Module], optimizer: ZeroOptimizer) -> list[tuple[str, Optional[Shard]]]:
    """For each optimizer parameter: its single-device name and the tp slice this rank holds."""
    by_id = {}
    for chunk in chunks:
        shards = param_shards(chunk)
        for name, param in chunk.named_parameters():
            logical = "embedding.tokens.weight" if param is chunk.tied_head_copy else name
            by_id[id(param)] = (logical, shards.get(name))
    return [by_id[id(p)] for p in optimizer.params]


def describe_shard(chunks, optimizer: ZeroOptimizer) -> dict:
    """What each element of this rank's shard is: parameters (logical name, local shape, tp slice)
    and the segments placing them in the shard. Two shards with equal descriptions are
    interchangeable element for element. Lists, not tuples, so a description read back from a
    file compares equal to a fresh one."""
    names = logical_names(chunks, optimizer)
    segments = torch.tensor([[s.param, s.param_offset, s.shard_offset, s.numel] for s in optimizer.layout.segments],
                            dtype=torch.int64).reshape(-1, 4)
    return {"params": [[name, list(p.shape), None if shard is None else [shard.dim, shard.index, shard.count]]
                       for (name, shard), p in zip(names, optimizer.params)],
            "segments": segments}


def rank_state(chunks, optimizer: ZeroOptimizer) -> dict:
    """This rank's checkpoint file: shards of master and moments, their description, scaler, RNG."""
    optimizer.apply_pending()
    step_tensor = next(iter(optimizer.adam.state.values()))["step"] if optimizer.adam.state else torch.zeros(())
    return {
        **describe_shard(chunks, optimizer),
        "master": optimizer.master, "exp_avg": optimizer.exp_avg, "exp_avg_sq": optimizer.exp_avg_sq,
        "adam_step": float(step_tensor),
        "scaler": {"kind": type(optimizer.scaler).__name__, **optimizer.scaler.state_dict()},
        "rng": rng_state(chunks),
    }


def rng_state(chunks) -> dict:
    state = {"cpu": torch.get_rng_state(), "tp": [getattr(c, "tp_rng", None) and c.tp_rng.state for c in chunks]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(chunks, state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    for chunk, tp_state in zip(chunks, state["tp"]):
        if tp_state is not None and getattr(chunk, "tp_rng", None) is not None:
            chunk.tp_rng.state = tp_state


def load_checkpoint(ckpt, rank: int, chunks, optimizer: ZeroOptimizer, manifest: dict, same_layout: bool) -> bool:
    """Load ``ckpt`` into this rank; returns True for an exact (same-layout) resume.

    The fast path reads only this rank's own file, random generators included, and is taken only
    when that file's shard description equals this rank's: a layout dict can match while the flat
    buckets differ (another bucket size, precision or persistence threshold), and copying shards
    then would scramble every parameter. Otherwise the checkpoint is resharded.
    """
    optimizer.apply_pending()  # an update applied after the load would overwrite it
    if same_layout and rank_file(rank) in manifest["files"]:
        mine = describe_shard(chunks, optimizer)
        saved = _description(ckpt, rank, manifest)
        if saved["params"] == mine["params"] and torch.equal(saved["segments"], mine["segments"]):
            state = load_file(ckpt, rank_file(rank), manifest=manifest)
            for key in STATE_KEYS:
                getattr(optimizer, key).copy_(state[key])
            _finish_load(optimizer, state["adam_step"], state["scaler"], ckpt)
            restore_rng(chunks, state["rng"])
            return True
    load_resharded(ckpt, chunks, optimizer, manifest)
    return False


def _description(ckpt, rank: int, manifest: dict) -> dict:
    name = index_file(rank) if index_file(rank) in manifest["files"] else rank_file(rank)
    return load_file(ckpt, name, manifest=manifest)


def load_resharded(ckpt, chunks, optimizer: ZeroOptimizer, manifest: dict) -> None:
    """Any other layout: rebuild the logical tensors this rank needs, then take the new slices.

    Only the old files holding a parameter this rank needs are read (found from the small index
    files): a pipeline stage reads its own stage's files, not the whole checkpoint."""
    needed = {name for name, _ in logical_names(chunks, optimizer)}
    old_world = int(manifest["world_size"])
    pieces: dict[tuple[str, int], dict] = {}
    adam_step, scaler = None, None
    for r in range(old_world):
        if not any(name in needed for name, _, _ in _description(ckpt, r, manifest)["params"]):
            continue
        state = load_file(ckpt, rank_file(r), manifest=manifest)
        # A rank whose shard was all padding saved step 0: take the largest.
        adam_step = max(adam_step or 0.0, state["adam_step"])
        scaler = scaler or state["scaler"]
        for param, param_offset, shard_offset, numel in state["segments"].tolist():
            name, shape, shard = state["params"][param]
            if name not in needed:
                continue
            entry = pieces.setdefault((name, 0 if shard is None else shard[1]), {
                "shape": shape, "shard": shard, **{k: torch.zeros(_numel(shape)) for k in STATE_KEYS}})
            for key in STATE_KEYS:
                entry[key][param_offset:param_offset + numel] = state[key][shard_offset:shard_offset + numel]
    if scaler is None:
        raise CheckpointError(f"{ckpt}: holds no parameter of this rank's model part; was it saved from a "
                              "different model?")
    full = _assemble(pieces)
    names = logical_names(chunks, optimizer)
    for seg in optimizer.layout.segments:
        name, shard = names[seg.param]
        if name not in full:
            raise CheckpointError(f"{ckpt}: has no parameter {name!r}; was it saved from a different model?")
        shape = tuple(optimizer.params[seg.param].shape)
        for key in STATE_KEYS:
            local = fit_to_shard(full[name][key], shard, shape, name, ckpt)
            getattr(optimizer, key)[seg.shard_offset:seg.shard_offset + seg.numel] = \
                local.reshape(-1)[seg.param_offset:seg.param_offset + seg.numel]
    _finish_load(optimizer, adam_step, scaler, ckpt)


def load_full_weights(ckpt) -> dict[str, torch.Tensor]:
    """Every logical parameter's fp32 master value, whole (for a single-process model or export)."""
    manifest = read_manifest(ckpt)
    pieces: dict[tuple[str, int], dict] = {}
    for r in range(int(manifest["world_size"])):
        state = load_file(ckpt, rank_file(r), manifest=manifest)
        for param, param_offset, shard_offset, numel in state["segments"].tolist():
            name, shape, shard = state["params"][param]
            entry = pieces.setdefault((name, 0 if shard is None else shard[1]),
                                      {"shape": shape, "shard": shard, "master": torch.zeros(_numel(shape))})
            entry["master"][param_offset:param_offset + numel] = state["master"][shard_offset:shard_offset + numel]
    return {name: value["master"] for name, value in _assemble(pieces, keys=("master",)).items()}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _assemble(pieces: dict, keys=STATE_KEYS) -> dict[str, dict[str, torch.Tensor]]:
    """Concatenate tensor-parallel slices back into logical tensors."""
    by_name: dict[str, list] = {}
    for (name, index), entry in pieces.items():
        by_name.setdefault(name, []).append((index, entry))
    full = {}
    for name, parts in by_name.items():
        parts.sort(key=lambda item: item[0])
        shard = parts[0][1]["shard"]
        full[name] = {}
        for key in keys:
            tensors = [entry[key].reshape(entry["shape"]) for _, entry in parts]
            full[name][key] = tensors[0] if shard is None else torch.cat(tensors, dim=shard[0])
    return full


VOCAB_PADDED = ("embedding.tokens.weight", "lm_head.weight")


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
        resized = torch.zeros(target, dtype=full.dtype)
        rows = min(full.shape[0], target[0])
        resized[:rows] = full[:rows]
        full = resized
    return full if shard is None else shard.take(full)


def _finish_load(optimizer: ZeroOptimizer, adam_step: float, scaler: dict, ckpt) -> None:
    for state in optimizer.adam.state.values():
        state["step"].fill_(adam_step)
    scaler = dict(scaler)
    kind = scaler.pop("kind", None)
    if kind == type(optimizer.scaler).__name__:
        optimizer.scaler.load_state_dict(scaler)
    else:  # precision changed (e.g. fp16 -> bf16): the saved scale means nothing to this run
        print(f"megazero: {ckpt}: loss scaler {kind} not carried over to {type(optimizer.scaler).__name__}; "
              "it starts afresh", flush=True)
    optimizer.reload_params()
