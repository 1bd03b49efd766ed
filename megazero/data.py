"""The engine's view of the data: blended train and validation samples for a config.

Index files are cached on disk under a file lock, so when every rank asks at once one builds them
and the others wait and load (``data_pipeline.index_cache``).
"""

from __future__ import annotations

from megazero.config import Config
from megazero.errors import ConfigError


def train_samples(cfg: Config, step: int = 0, consumed: int = 0, built: int | None = None) -> int:
    """The training samples a run draws in all, for which its sample indices are built. Resumed at
    ``step`` with ``consumed`` samples, a run by steps draws those and at most a global batch a step
    left: where the batch was cut since (2 steps of 8 samples, then 2 more of 4), the steps' product
    alone (16) fell short of the samples drawn (24), and the first step past it stopped on a
    traceback. Never fewer than ``built``, the count the checkpoint's run built its indices for: the
    same count gives the same order, which a run that draws no more keeps whatever its batch."""
    t = cfg.train
    if t.train_steps is not None:
        left = max(t.train_steps - step, 0)
        count = max(t.train_steps * t.global_batch_size, consumed + left * t.global_batch_size)
    else:
        count = -(-t.train_tokens // cfg.model.seq_length) + t.global_batch_size
    return max(count, built or 0)


def eval_samples(cfg: Config) -> int:
    """The samples one evaluation reads, for which the validation index is built."""
    return cfg.train.eval_steps * cfg.train.global_batch_size


def repeated_validation(valid, cfg: Config) -> list[str]:
    """Notes for the datasets whose validation split holds fewer samples than an evaluation reads from
    it: the same samples are then read again and again (the last time in part), which weighs them
    unevenly and costs evaluation time for nothing; Megatron does the same without a word."""
    if valid is None:
        return []
    import numpy as np

    counts = np.bincount(valid.dataset_index, minlength=len(valid.datasets))
    notes = []
    for dataset, count in zip(valid.datasets, counts.tolist()):
        if dataset is None:  # weight 0: nothing read
            continue
        held = dataset.samples_per_epoch()
        if count > held:
            notes.append(f"an evaluation reads {count:,} samples of {dataset.data.prefix}'s validation split, "
                         f"which holds {held:,}: each is read about {count / held:.1f} times (train.eval_steps "
                         f"{cfg.train.eval_steps} x train.global_batch_size {cfg.train.global_batch_size}); fewer "
                         "eval_steps read each once")
    return notes


def build_datasets(cfg: Config, train_samples: int):
    """(train, validation or None) sample sequences of ``seq_length + 1`` tokens."""
    from data_pipeline.blend import build_blended_samples, resolve_blend
    from data_pipeline.index_cache import CacheWriteError

    d = cfg.data
    if d.blend is None and d.blend_preset is None:
        raise ConfigError("data.blend: no training data; give [[weight, prefix], ...] of preprocessed "
                          "datasets (megazero preprocess) or data.blend_preset with data.blend_root")
    try:
        blend = resolve_blend(d.blend, d.blend_preset, d.blend_root)
        train = build_blended_samples(blend, cfg.model.seq_length, train_samples, d.seed, d.split, "train",
                                      d.cache_dir)
        valid = None
        if cfg.train.eval_interval:
            valid = build_blended_samples(blend, cfg.model.seq_length, eval_samples(cfg), d.seed, d.split, "valid",
                                          d.cache_dir)
    except CacheWriteError as exc:  # a full disk, or data made read-only since preflight cached its facts
        raise ConfigError(f"data.cache_dir: the sample indices cannot be written ({exc}); free space there or set "
                          "data.cache_dir to a writable directory") from None
    except (ValueError, OSError) as exc:  # a shard that cannot be read: the error names it
        raise ConfigError(f"data: {exc}") from None
    return train, valid


def shard_digests(cfg: Config) -> dict[str, str]:
    """Each training shard's ``.idx`` digest (``IndexedDataset.fingerprint``) by its real path, as
    checkpoints record them: a resume compares them, since a shard preprocessed again in place keeps
    its path, and the samples consumed so far would then count through other documents. Read from
    the file, without opening the shard as a dataset (whose checks pass over every document entry:
    the data's own checks do that); shards whose ``.idx`` cannot be read are left out (their own
    check says why)."""
    from data_pipeline.shard_files import idx_sha256

    return _by_shard(cfg, lambda prefix: idx_sha256(prefix)[0])


def shard_token_digests(cfg: Config) -> dict[str, str]:
    """Each training shard's ``tokens_digest`` by its real path, recorded beside ``shard_digests``: a
    corpus of equal-length documents preprocessed again in another order has the same ``.idx``
    bytes, and only its tokens tell the resume that it changed."""
    from data_pipeline.shard_files import tokens_digest

    return _by_shard(cfg, tokens_digest)


def _by_shard(cfg: Config, digest) -> dict[str, str]:
    """``digest(prefix)`` of each shard of the training blend, by real path; shards it cannot read are
    left out, and so is every shard of a blend that does not parse (their checks say why)."""
    import os

    from data_pipeline.blend import parse_blend, resolve_blend

    d = cfg.data
    try:
        _, prefixes = parse_blend(resolve_blend(d.blend, d.blend_preset, d.blend_root))
    except (ValueError, OSError):
        return {}
    digests = {}
    for prefix in prefixes:
        try:
            digests[os.path.realpath(prefix)] = digest(prefix)
        except OSError:
            continue
    return digests


def tokenizer_record(cfg: Config) -> dict | None:
    """The tokenizer the run's token ids come from, as its checkpoints record it (``shard_origin``'s
    identity: the file's digest, vocabulary size and name): ``data.tokenizer`` where set (preflight
    has checked that the shards agree), else what the blend's shards record; None where neither says.
    ``generate`` and ``convert --to hf`` compare a tokenizer they are given with it: one of another
    vocabulary within the model's size would otherwise decode and export without a word."""
    from data_pipeline.blend import parse_blend, resolve_blend
    from data_pipeline.shard_origin import common_origin, tokenizer_identity
    from data_pipeline.tokenizer import load_tokenizer

    d = cfg.data
    try:  # preflight read the same files; one changed since is still one line
        if d.tokenizer is not None:
            return tokenizer_identity(load_tokenizer(d.tokenizer))
        origin = common_origin(parse_blend(resolve_blend(d.blend, d.blend_preset, d.blend_root))[1])
    except (ValueError, OSError) as exc:
        raise ConfigError(f"data.tokenizer: {exc}") from None
    return origin[1] if origin else None


def recorded_tokenizer(meta: dict) -> dict | None:
    """The tokenizer record a checkpoint's ``meta`` holds (``tokenizer_record``), or None where it
    holds none (an older checkpoint, one imported from another framework)."""
    record = meta.get("tokenizer")
    return record if isinstance(record, dict) and "tokenizer_sha256" in record else None


def not_trained_with(meta: dict, tokenizer, flag: str) -> str | None:
    """Why the loaded ``tokenizer`` (given as ``flag``) is not the one the checkpoint of ``meta`` was
    trained with (``tokenizer_record``); None if it is, or if the checkpoint records none (an older
    one, one imported from another framework, or a run whose data named no tokenizer)."""
    from data_pipeline.shard_origin import describe, other_tokenizer

    record = recorded_tokenizer(meta)
    if record is None:
        return None
    mine = other_tokenizer(record, tokenizer)
    if mine is None:
        return None
    trained = ((meta.get("config") or {}).get("data") or {}).get("tokenizer")
    where = f", at {trained} when it trained" if trained else ""
    return (f"{flag} {tokenizer.path}: is not the tokenizer this checkpoint was trained with ({describe(record)}"
            f"{where}; this one has {mine['vocab_size']} tokens and other pieces); pass that one with --tokenizer")
