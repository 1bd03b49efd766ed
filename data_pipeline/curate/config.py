"""The pipeline config: one YAML file naming the inputs, the stages in order and each stage's options.

::

    input: {paths: [raw/*.jsonl.gz], text_field: text}
    output: {dir: curated}
    executor: {kind: local, workers: 8}
    stages: [clean, exact_dedup, quality, fuzzy_dedup, decontaminate]
    quality: {model: quality.bin, alpha: 3}
    decontaminate: {tasks: [eval/lambada.jsonl]}
    preprocess: {tokenizer: tokenizer.model}   # optional: tokenize and write blend.yaml

Every field can be overridden on the command line as ``--section.field VALUE``. Every field is
checked when the config is built, before any stage runs; errors name the dotted field and what it
should be.
"""

from __future__ import annotations

import difflib
import fnmatch
import glob
import os
from dataclasses import dataclass, field
from typing import Optional

from data_pipeline.curate.checks import within
from data_pipeline.curate.clean import CleanConfig
from data_pipeline.curate.decontaminate import DecontaminateConfig
from data_pipeline.curate.exact_dedup import ExactDedupConfig
from data_pipeline.curate.fuzzy_dedup import FuzzyDedupConfig
from data_pipeline.curate.quality import QualityConfig
from data_pipeline.curate.runner import EXECUTORS
from data_pipeline.curate.shards import DEFAULT_ID_FIELD, FORMATS
from data_pipeline.paths import empty_path_problem, file_identity, file_in_the_way
from data_pipeline.sources import JSONL_SUFFIXES, PARQUET_SUFFIXES, check_compression, check_json_lines, missing_columns
from data_pipeline.tokenizer import load_tokenizer, require_eod
from data_pipeline.typed_config import build_dataclass

STAGES = ("clean", "quality", "exact_dedup", "fuzzy_dedup", "decontaminate")


@dataclass
class InputConfig:
    paths: list[str] = field(default_factory=list)  # files or glob patterns: .jsonl(.gz/.zst), .parquet
    text_field: str = "text"
    id_field: str = DEFAULT_ID_FIELD  # a record without it gets the id FILE:LINE (FILE:ROW for parquet)
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

    def problems(self) -> list[str]:
        """Out-of-range options: a weight of 0 or less is written into blend.yaml as it is."""
        return (within("preprocess.workers", self.workers, 1)
                + within("preprocess.weight", self.weight, 0, low_open=True,
                         meaning="it is the curated dataset's weight in blend.yaml"))

    def file_problems(self) -> list[str]:
        """Load the tokenizer now (it is small): a bad path would otherwise fail after every stage."""
        if not self.tokenizer:
            return []
        try:
            require_eod(load_tokenizer(self.tokenizer), "to end each curated document with")
        except (OSError, ValueError) as exc:
            return [f"preprocess.tokenizer: {exc}"]
        return []


@dataclass
class CurateConfig:
    input: InputConfig = field(default_factory=InputConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    stages: list[str] = field(default_factory=lambda: ["clean", "exact_dedup", "fuzzy_dedup"])
    strict: bool = False  # any bad input record is fatal (default: counted in stats.json and left out)
    clean: CleanConfig = field(default_factory=CleanConfig)
    quality: QualityConfig = field(default_factory=QualityConfig)
    exact_dedup: ExactDedupConfig = field(default_factory=ExactDedupConfig)  # no options
    fuzzy_dedup: FuzzyDedupConfig = field(default_factory=FuzzyDedupConfig)
    decontaminate: DecontaminateConfig = field(default_factory=DecontaminateConfig)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)


def build_config(raw: dict, base_dir: str = ".") -> CurateConfig:
    """A checked ``CurateConfig`` from parsed YAML; relative input paths are relative to ``base_dir``.

    Every option is checked here, before any stage runs, whether or not its stage is listed; the
    files a listed stage reads (model, tasks) and the tokenizer are checked after the values, so a
    run never fails or quietly changes what it removes hours in. Each problem is one line.
    """
    cfg = build_dataclass(CurateConfig, {k.replace("-", "_"): v for k, v in raw.items()})
    cfg.stages = [str(s).replace("-", "_") for s in cfg.stages]
    _refuse(_value_problems(cfg))
    _expand_home(cfg)
    patterns, cfg.input.paths = cfg.input.paths, expand_inputs(cfg.input.paths, base_dir)
    _refuse(output_overlap(patterns, cfg.input.paths, base_dir, cfg.output.dir) + _output_dir_problems(cfg.output.dir))
    _refuse(_input_problems(cfg.input.paths, cfg.input.text_field) + _file_problems(cfg))
    return cfg


def _expand_home(cfg: CurateConfig) -> None:
    """``~`` in the paths besides the inputs' (which ``expand_inputs`` expands) is the user's home, as
    a shell would make it: ``quality.model: ~/q.bin`` was looked for under a folder named ``~``."""
    home = os.path.expanduser
    cfg.output.dir = home(cfg.output.dir)
    cfg.quality.model = cfg.quality.model and home(cfg.quality.model)
    cfg.decontaminate.tasks = [home(str(t)) for t in cfg.decontaminate.tasks]
    cfg.preprocess.tokenizer = cfg.preprocess.tokenizer and home(cfg.preprocess.tokenizer)


def _output_dir_problems(out_dir: str) -> list[str]:
    blocking = file_in_the_way(os.path.join(out_dir, "shard"))
    return [f"output.dir: {out_dir}: {blocking} is a file, not a folder; choose another output.dir"] if blocking else []


def _refuse(problems: list[str]) -> None:
    if problems:
        raise ValueError("\n".join(problems))


def _value_problems(cfg: CurateConfig) -> list[str]:
    problems = _stage_list_problems(cfg.stages) + _empty_path_problems(cfg)
    if cfg.output.format not in FORMATS:
        problems.append(f"output.format: {cfg.output.format!r} is not one of {', '.join(FORMATS)}")
    if cfg.executor.kind not in EXECUTORS:
        problems.append(f"executor.kind: {cfg.executor.kind!r} is not one of {', '.join(EXECUTORS)}")
    problems += within("input.shard_docs", cfg.input.shard_docs, 1, meaning="it is the documents per shard")
    problems += within("executor.workers", cfg.executor.workers, 1)
    problems += cfg.preprocess.problems()
    for name in STAGES:
        problems += getattr(cfg, name).problems()
    return problems


def _empty_path_problems(cfg: CurateConfig) -> list[str]:
    """``output.dir`` or ``preprocess.tokenizer`` given as an empty string (an unset variable in a
    generated config): the run would write its stages into the current folder, or skip tokenizing
    as if no tokenizer were set, and say nothing of either."""
    problems = []
    folder = empty_path_problem(cfg.output.dir, "folder", "give the folder to write the run into")
    if folder:
        problems.append(f"output.dir: {folder}")
    if cfg.preprocess.tokenizer == "":
        problems.append("preprocess.tokenizer: an empty path names no tokenizer; give the tokenizer file to tokenize "
                        "the curated shards with, or leave the field out to stop before tokenizing")
    return problems


def _stage_list_problems(stages: list[str]) -> list[str]:
    problems = []
    for name in stages:
        if name not in STAGES:
            close = difflib.get_close_matches(name, STAGES, n=1)
            hint = f"did you mean {close[0]}?" if close else f"known stages: {', '.join(STAGES)}"
            problems.append(f"stages: unknown stage {name!r}; {hint}")
    if len(set(stages)) != len(stages):
        problems.append(f"stages: a stage is listed twice in {stages}")
    return problems


def _input_problems(paths: list[str], text_field: str) -> list[str]:
    """What each input's first bytes or footer show, so that a file ingest would fail on, or lose
    whole, is found before the inputs ahead of it are ingested: a compressed name on other data, a
    JSON array, a parquet footer that does not read or lacks the text column."""
    problems = []
    for path in paths:
        try:
            check_compression(path)
            check_json_lines(path)
            missing, columns = missing_columns(path, (text_field,))
            if missing:
                problems.append(f"input.paths: {path}: no column {text_field!r} (columns: {columns}); "
                                "set input.text_field")
        except ValueError as exc:
            problems.append(f"input.paths: {exc}")
        except OSError as exc:  # unreadable: said here, not as a traceback from the first read
            problems.append(f"input.paths: {path}: cannot be read ({exc.strerror})")
    return problems


def _file_problems(cfg: CurateConfig) -> list[str]:
    """The quality model and task files when their stage is listed (a config may leave an unused
    stage's files unset), and the tokenizer when it is set."""
    problems = [p for name in cfg.stages if name in ("quality", "decontaminate")
                for p in getattr(cfg, name).file_problems()]
    return problems + cfg.preprocess.file_problems()


def expand_inputs(patterns: list, base_dir: str) -> list[str]:
    if not patterns:
        raise ValueError("input.paths: no inputs; list jsonl (.jsonl, .jsonl.gz, .jsonl.zst) or parquet files")
    paths = []
    for pattern in patterns:
        pattern = os.path.normpath(os.path.join(base_dir, os.path.expanduser(str(pattern))))
        found = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        folder = next((p for p in found if os.path.isdir(p)), None)
        if folder:
            raise ValueError(f"input.paths: {folder}: is a folder; give the files in it (a glob such as "
                             f"{os.path.join(folder, '*.jsonl')}), or narrow the glob")
        missing = [p for p in found if not os.path.isfile(p)]
        if not found or missing:
            raise ValueError(f"input.paths: {missing[0] if missing else pattern}: no such file; fix the path")
        unknown = next((p for p in found if not p.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES)), None)
        if unknown:  # read as jsonl, each of its lines would be a bad record and the file lost to a count
            raise ValueError(f"input.paths: {unknown}: unknown input type; use .jsonl/.json (optionally .gz or "
                             ".zst) or .parquet, or narrow the glob")
        paths += found
    same = [file_identity(p) for p in paths]  # links followed, hard ones too
    twice = next((p for i, p in enumerate(paths) if same[i] in same[:i]), None)
    if twice is not None:  # its documents would be ingested twice, each a duplicate of itself
        raise ValueError(f"input.paths: {twice} is listed twice (two patterns find it, or it is a link to "
                         "another input); list each file once")
    names = [os.path.basename(p) for p in paths]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"input.paths: two inputs are named {dup}; a document without an id is named FILE:LINE, "
                         "so give the inputs distinct file names")
    return paths


OUTPUT_FILES = tuple(f"shard-00000-00000.{fmt}" for fmt in FORMATS) + ("edges.jsonl", "removed.jsonl")
"""The data files a run writes, each in a folder at least one level below ``output.dir``."""
_FOLDERS = object()  # one or more folders of any name


def output_overlap(patterns: list, paths: list[str], base_dir: str, out_dir: str) -> list[str]:
    """An input inside ``output.dir``, or a pattern that would find the run's own shards there: the
    first run passes, and a rerun (or the next config over the same folders) ingests its outputs
    as new documents, every one kept twice."""
    out = os.path.abspath(out_dir)
    inside = [p for p in paths if os.path.abspath(p).startswith(out + os.sep)]
    if inside:
        return [f"input.paths: {inside[0]} is inside output.dir {out_dir}; move the input or choose another output.dir"]
    target = [*out.split(os.sep), _FOLDERS, OUTPUT_FILES]
    for pattern in patterns:
        full = os.path.abspath(os.path.join(base_dir, os.path.expanduser(str(pattern))))
        if glob.has_magic(full) and _can_match(full.split(os.sep), target):
            return [f"input.paths: {pattern} would also match the shards this run writes under output.dir {out_dir} "
                    "(a rerun would ingest them); choose an output.dir the pattern cannot reach, or narrow the pattern"]
    return []


def _can_match(pattern: list[str], target: list) -> bool:
    """Whether glob components ``pattern`` match some path of ``target``: folder names, then
    ``_FOLDERS``, then a tuple of file names, any one of which ends the path."""
    if not pattern:
        return not target
    head, rest = pattern[0], pattern[1:]
    if head == "**" and not rest:  # a final ** takes whatever is left
        return True
    if not target:
        return head == "**" and _can_match(rest, target)
    first = target[0]
    if head == "**":  # zero components, or one more (recursion takes the rest)
        if first is _FOLDERS:  # swallowing some folders leaves one or more: the same target
            return _can_match(rest, target) or _can_match(rest, target[1:])
        return _can_match(rest, target) or (not isinstance(first, tuple) and _can_match(pattern, target[1:]))
    if first is _FOLDERS:  # head names one folder; more may follow
        return _can_match(rest, target) or _can_match(rest, target[1:])
    if isinstance(first, tuple):
        return not rest and any(fnmatch.fnmatchcase(name, head) for name in first)
    return fnmatch.fnmatchcase(first, head) and _can_match(rest, target[1:])
