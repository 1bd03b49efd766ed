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

import difflib
import glob
import os
from dataclasses import dataclass, field
from typing import Optional

from data_pipeline.curate.clean import CleanConfig
from data_pipeline.curate.decontaminate import DecontaminateConfig
from data_pipeline.curate.fuzzy_dedup import FuzzyDedupConfig
from data_pipeline.curate.quality import QualityConfig
from data_pipeline.curate.shards import FORMATS
from data_pipeline.typed_config import build_dataclass

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
    cfg = build_dataclass(CurateConfig, {k.replace("-", "_"): v for k, v in raw.items()})
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
