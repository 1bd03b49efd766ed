"""The engine's view of the data: blended train and validation samples for a config.

Index files are cached on disk under a file lock, so when every rank asks at once one builds them
and the others wait and load (``data_pipeline.index_cache``).
"""

from __future__ import annotations

from megazero.config import Config
from megazero.errors import ConfigError


def train_samples(cfg: Config) -> int:
    """The training samples a run draws in all, for which its sample indices are built."""
    t = cfg.train
    if t.train_steps is not None:
        return t.train_steps * t.global_batch_size
    return -(-t.train_tokens // cfg.model.seq_length) + t.global_batch_size


def build_datasets(cfg: Config, train_samples: int):
    """(train, validation or None) sample sequences of ``seq_length + 1`` tokens."""
    from data_pipeline.blend import build_blended_samples, resolve_blend

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
            valid = build_blended_samples(blend, cfg.model.seq_length,
                                          cfg.train.eval_steps * cfg.train.global_batch_size, d.seed, d.split,
                                          "valid", d.cache_dir)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"data: {exc}") from None
    return train, valid
