"""The pipeline config: one YAML file naming the inputs, the stages in order and each stage's options.

::

    input: {paths: [raw/*.jsonl.gz], text_field: text}
    output: {dir: curated}
    executor: {kind: local, workers: 8}
    stages: [clean, exact_dedup, quality, fuzzy_dedup, decontaminate]
    quality: {model: quality.bin, alpha: 3}
    decontaminate: {tasks: [eval/lambada.jsonl]}
    preprocess: {tokenizer: tokenizer.model}   # optional: tokenize and write blend.yaml

Every field can be overridden on the command line as ``--section.field VALUE``. Errors name the
dotted field and what it should be.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import os
import typing
from dataclasses import dataclass, field
from typing import Optional

from data_pipeline.curate.clean import CleanConfig
from data_pipeline.curate.decontaminate import DecontaminateConfig
from data_pipeline.curate.fuzzy_dedup import FuzzyDedupConfig
from data_pipeline.curate.quality import QualityConfig
from data_pipeline.curate.shards import FORMATS

STAGES = ("clean", "quality", "exact_dedup", "fuzzy_dedup", "decontaminate")


@dataclass
class InputConfig:
    paths: list = field(default_factory=list)  # files or glob patterns: .jsonl(.gz/.zst), .parquet
    text_field: str = "text"
    id_field: str = "id"  # a record without it gets the id FILE:LINE (FILE:ROW for parquet)
    shard_docs: int = 10_000  # documents per shard: the unit of work and of memory


@dataclass
class OutputConfig:
    dir: str = "curated"
    format: str = "jsonl"  # jsonl, jsonl.gz, jsonl.zst or parquet, for every stage's shards


@dataclass
class ExecutorConfig:
    kind: str = "local"  # local (a process pool) or ray
    workers: int = 1
    ray_address: Optional[str] = None  # None starts a local Ray instance; "auto" joins a running cluster


@dataclass
class PreprocessConfig:
    tokenizer: Optional[str] = None  # set it to tokenize the curated shards and write blend.yaml
    workers: int = 1
    weight: float = 1.0  # the curated dataset's weight in blend.yaml


@dataclass
class CurateConfig:
    input: InputConfig = field(default_factory=InputConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    stages: list = field(default_factory=lambda: ["clean", "exact_dedup", "fuzzy_dedup"])
    strict: bool = False  # any bad input record is fatal (default: counted in stats.json and left out)
    clean: CleanConfig = field(default_factory=CleanConfig)
    quality: QualityConfig = field(default_factory=QualityConfig)
    exact_dedup: dict = field(default_factory=dict)  # no options
    fuzzy_dedup: FuzzyDedupConfig = field(default_factory=FuzzyDedupConfig)
    decontaminate: DecontaminateConfig = field(default_factory=DecontaminateConfig)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)


def build_config(raw: dict, base_dir: str = ".") -> CurateConfig:
    """A checked ``CurateConfig`` from parsed YAML; relative input paths are relative to ``base_dir``."""
    cfg = _build(CurateConfig, {k.replace("-", "_"): v for k, v in raw.items()}, "")
    cfg.stages = [str(s).replace("-", "_") for s in cfg.stages]
    for name in cfg.stages:
        if name not in STAGES:
            close = difflib.get_close_matches(name, STAGES, n=1)
            hint = f"did you mean {close[0]}?" if close else f"known stages: {', '.join(STAGES)}"
            raise ValueError(f"stages: unknown stage {name!r}; {hint}")
    if len(set(cfg.stages)) != len(cfg.stages):
        raise ValueError(f"stages: a stage is listed twice in {cfg.stages}")
    if cfg.output.format not in FORMATS:
        raise ValueError(f"output.format: {cfg.output.format!r} is not one of {', '.join(FORMATS)}")
    if cfg.input.shard_docs < 1:
        raise ValueError("input.shard_docs must be at least 1")
    cfg.input.paths = expand_inputs(cfg.input.paths, base_dir)
    return cfg


def expand_inputs(patterns: list, base_dir: str) -> list[str]:
    if not patterns:
        raise ValueError("input.paths: no inputs; list jsonl (.jsonl, .jsonl.gz, .jsonl.zst) or parquet files")
    paths = []
    for pattern in patterns:
        pattern = os.path.normpath(os.path.join(base_dir, os.path.expanduser(str(pattern))))
        found = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        missing = [p for p in found if not os.path.isfile(p)]
        if not found or missing:
            raise ValueError(f"input.paths: {missing[0] if missing else pattern}: no such file; fix the path")
        paths += found
    names = [os.path.basename(p) for p in paths]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"input.paths: two inputs are named {dup}; document ids are FILE:LINE, so give the "
                         "inputs distinct file names (or an id field, input.id_field)")
    return paths


def _build(cls: type, raw, prefix: str):
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping of fields, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean {prefix}{close[0]}?" if close else f"known fields: {', '.join(names)}"
            raise ValueError(f"{prefix}{key}: unknown field; {hint}")
    values = {}
    for name in names:
        if name in raw:
            hint = hints[name]
            values[name] = (_build(hint, raw[name] or {}, f"{prefix}{name}.") if dataclasses.is_dataclass(hint)
                            else _coerce(raw[name], hint, f"{prefix}{name}"))
    return cls(**values)


def _coerce(value, hint, name: str):
    if typing.get_origin(hint) is typing.Union:
        return None if value is None else _coerce(value, typing.get_args(hint)[0], name)
    ok = {bool: isinstance(value, bool),
          int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool),
          str: isinstance(value, str),
          list: isinstance(value, (list, tuple)),
          dict: isinstance(value, dict) or value is None}.get(hint, True)
    if hint is list and isinstance(value, str):
        return [value]
    if not ok:
        raise ValueError(f"{name}: expected {getattr(hint, '__name__', hint)}, got {value!r}")
    if hint is float:
        return float(value)
    if hint is list:
        return list(value)
    return value if value is not None else {}
