"""Running a curation config: ingest, the stages in order, optional tokenizing, blend file and report.

Layout of ``output.dir``::

    00-input/            the inputs as shards with document ids
    01-clean/ ...        one directory per stage: its output shards, stats.json, stage.json (the
                         options it ran with), .done/ (completion markers), sub-stage directories
    tokenized/           curated_text_document.bin/.idx (with preprocess.tokenizer)
    blend.yaml           the blend `megazero train` reads (--data.blend_preset, --data.blend_root)
    report.md, report/   documents and bytes per stage, plots

A stage whose stats.json exists is complete and is skipped on a rerun; inside a stage, finished
tasks are skipped by their markers. Each stage's stage.json records what made it: its options, the
files it reads (path, size, modification time: the inputs, a quality model, task files) and a digest
of the stage before it, so a change anywhere upstream reaches every later stage. A complete stage
made otherwise is an error (a rerun never mixes the outputs of two configs, or serves what an
earlier config made); an incomplete one is discarded and run again.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass

import yaml

from data_pipeline.curate import decontaminate as dc
from data_pipeline.curate import exact_dedup as ex
from data_pipeline.curate import fuzzy_dedup as fz
from data_pipeline.curate.clean import clean_shard
from data_pipeline.curate.config import CurateConfig
from data_pipeline.curate.quality import quality_shard
from data_pipeline.curate.report import changes, write_report
from data_pipeline.curate.runner import Task, make_executor, merge_stats, run_tasks
from data_pipeline.curate.shards import (UNREADABLE, atomic_write_text, conform_shards, ingest_file, list_shards,
                                         unified_schema)


@dataclass
class Context:
    cfg: CurateConfig
    executor: object
    progress: bool

    @property
    def text_field(self) -> str:
        return self.cfg.input.text_field

    def run(self, directory: str, tasks: list[Task], desc: str) -> list[dict]:
        return run_tasks(self.executor, directory, tasks, desc, self.progress)

    def map_shards(self, shards: list[str], out_dir: str, fn: Callable, args_for: Callable, desc: str) -> list[dict]:
        """``fn(in_shard, out_shard, *args_for(i, in_shard))`` for every shard, the output named as the input."""
        tasks = [Task(_stem(s), fn, (s, os.path.join(out_dir, os.path.basename(s)), *args_for(i, s)))
                 for i, s in enumerate(shards)]
        return self.run(out_dir, tasks, desc)


def _stem(path: str) -> str:
    return os.path.basename(path).split(".")[0]


def _subdir(parent: str, name: str) -> str:
    path = os.path.join(parent, name)
    os.makedirs(path, exist_ok=True)
    return path


def run_ingest(ctx: Context, out_dir: str) -> dict:
    i = ctx.cfg.input
    tasks = [Task(f"input-{k:05d}", ingest_file, (path, k, out_dir, ctx.cfg.output.format, i.text_field, i.id_field,
                                                  i.shard_docs, ctx.cfg.strict))
             for k, path in enumerate(i.paths)]
    results = ctx.run(out_dir, tasks, "input")
    unreadable = [r[UNREADABLE] for r in results if UNREADABLE in r]
    if unreadable:  # its fix changes an input or input.text_field, and so this stage's fingerprint: none is kept
        _discard(out_dir)
        more = f" (and {len(unreadable) - 1} more input files alike)" if len(unreadable) > 1 else ""
        raise ValueError(f"input.paths: {unreadable[0]}{more}")
    parquet = sorted(glob.glob(os.path.join(out_dir, "*.parquet")))
    if parquet:  # one schema, which every later stage's shard keeps (``write_shard``'s ``like``)
        try:
            schema = unified_schema(parquet)
        except ValueError as mixed:
            _discard(out_dir)
            raise ValueError(f"input.paths: {mixed}; give the field one type in the input, or set output.format "
                             "to jsonl") from None
        conform_shards(parquet, schema)
    stats = merge_stats(results)
    if stats["docs_out"] == 0:  # nothing here is worth resuming: a corrected config starts afresh
        _discard(out_dir)  # (a file with records but no good one was refused above: every file is empty)
        raise ValueError(f"input.paths: no documents in {i.paths}: every input file is empty; give jsonl or parquet "
                         f"files of records with a {i.text_field!r} string (input.text_field)")
    return stats


def run_clean(ctx: Context, shards: list[str], out_dir: str) -> dict:
    return merge_stats(ctx.map_shards(shards, out_dir, clean_shard, lambda i, s: (ctx.text_field, ctx.cfg.clean),
                                      "clean"))


def run_quality(ctx: Context, shards: list[str], out_dir: str) -> dict:
    stats = merge_stats(ctx.map_shards(shards, out_dir, quality_shard,
                                       lambda i, s: (ctx.text_field, ctx.cfg.quality), "quality"))
    stats["alpha"] = ctx.cfg.quality.alpha
    return stats


def run_exact_dedup(ctx: Context, shards: list[str], out_dir: str) -> dict:
    hash_dir, dup_dir = _subdir(out_dir, "hashes"), _subdir(out_dir, "duplicates")
    hashes = [os.path.join(hash_dir, _stem(s)) for s in shards]
    parts = max(1, len(shards))
    ctx.run(hash_dir, [Task(_stem(s), ex.hash_shard, (s, h, ctx.text_field, parts)) for s, h in zip(shards, hashes)],
            "exact: hashes")
    drops = [os.path.join(dup_dir, f"part-{p:05d}.drops") for p in range(parts)]
    ctx.run(dup_dir, [Task(f"part-{p:05d}", ex.duplicates_in_partition, (hashes, p, d))
                      for p, d in enumerate(drops)], "exact: duplicates")
    return merge_stats(ctx.map_shards(shards, out_dir, ex.filter_shard,
                                      lambda i, s: (ctx.text_field, drops, i, "exact duplicate"), "exact: filter"))


def run_fuzzy_dedup(ctx: Context, shards: list[str], out_dir: str) -> dict:
    f = ctx.cfg.fuzzy_dedup
    sig_dir, bucket_dir, edge_dir = (_subdir(out_dir, n) for n in ("signatures", "buckets", "edges"))
    prefixes = [os.path.join(sig_dir, _stem(s)) for s in shards]
    parts = f.partitions or max(1, len(shards))
    ctx.run(sig_dir, [Task(_stem(s), fz.signature_shard, (s, p, ctx.text_field, f, parts))
                      for s, p in zip(shards, prefixes)], "fuzzy: signatures")
    buckets = [os.path.join(bucket_dir, f"part-{p:05d}.pairs") for p in range(parts)]
    candidates = ctx.run(bucket_dir, [Task(f"part-{p:05d}", fz.bucket_partition,
                                           (prefixes, p, parts, b, f.max_bucket_pairs))
                                      for p, b in enumerate(buckets)], "fuzzy: buckets")
    edges = [os.path.join(edge_dir, f"part-{p:05d}.npy") for p in range(parts)]
    verified = ctx.run(edge_dir, [Task(f"part-{p:05d}", fz.verify_partition,
                                       (buckets, prefixes, p, f.threshold, e))
                                  for p, e in enumerate(edges)], "fuzzy: edges")
    [comps] = ctx.run(out_dir, [Task("components", fz.components, (edges, prefixes, out_dir))], "fuzzy: components")
    removed = [os.path.join(out_dir, "removed.drops")]
    stats = merge_stats(ctx.map_shards(shards, out_dir, ex.filter_shard,
                                       lambda i, s: (ctx.text_field, removed, i, "near duplicate"), "fuzzy: filter"))
    return {**stats, **merge_stats(candidates + verified), **comps}


def run_decontaminate(ctx: Context, shards: list[str], out_dir: str) -> dict:
    d = ctx.cfg.decontaminate
    freq_dir = _subdir(out_dir, "doc_freq")
    tasks_path, ignored_path = os.path.join(out_dir, "task_ngrams.npz"), os.path.join(out_dir, "ignored.npy")
    [task_stats] = ctx.run(out_dir, [Task("task_ngrams", dc.build_task_ngrams, (d, tasks_path))],
                           "decontaminate: tasks")
    prefixes = [os.path.join(freq_dir, _stem(s)) for s in shards]
    ctx.run(freq_dir, [Task(_stem(s), dc.doc_freq_shard, (s, tasks_path, q, ctx.text_field, d.ngram))
                       for s, q in zip(shards, prefixes)], "decontaminate: frequencies")
    frequent = dc.frequent_ngrams([f"{q}.freq.npy" for q in prefixes], d.max_doc_freq)
    ex.save_array(ignored_path, frequent)
    stats = merge_stats(ctx.map_shards(shards, out_dir, dc.decontaminate_shard,
                                       lambda i, s: (f"{prefixes[i]}.hits.npy", tasks_path, ignored_path,
                                                     ctx.text_field, d), "decontaminate"))
    return {**stats, **task_stats, "ignored_frequent_ngrams": len(frequent), "ngram": d.ngram}


RUNNERS = {"clean": run_clean, "quality": run_quality, "exact_dedup": run_exact_dedup,
           "fuzzy_dedup": run_fuzzy_dedup, "decontaminate": run_decontaminate}


def _file_facts(path: str) -> list:
    """What a stage records of a file it reads: an edited or replaced file differs in size or time."""
    st = os.stat(path)
    return [path, st.st_size, st.st_mtime_ns]


RULES = 5
"""What the stages compute, in the input stage's fingerprint (so in every later one's upstream digest):
raised when a fix changes what a stage writes from the same inputs and options, so a finished stage
made by the code before is refused by name, not kept beside new ones. 2: parquet shards keep every
record's fields, quality scores are P(hq) among every label, shards in numeric order. 3: exact and
fuzzy dedup compare text in NFC. 4: clean keeps indentation and counts a Han or kana character after
a letter or digit as a word of its own; decontamination credits an n-gram of several tasks to each;
input keeps a whole-float id as its integer and counts an id of another kind as a bad record; parquet
shards keep the input's schema through every stage; the quality stage reads a document's ``__label__``
words as text. 5: decontamination reads words through invisible format characters (soft hyphens,
zero-width spaces and joiners)."""


def _digest(fingerprint: dict) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()


def _check_fingerprint(stage_dir: str, fingerprint: dict, complete: bool, log) -> None:
    """Record ``fingerprint`` in a new stage directory; a complete stage made with another is an error,
    an incomplete one (a run stopped, or failed on a setting since corrected) is discarded."""
    path = os.path.join(stage_dir, "stage.json")
    old = _read_json(path) if os.path.isfile(path) else None
    if old == fingerprint:
        return
    if old is not None:
        changed = sorted(k for k in fingerprint if old.get(k) != fingerprint[k])
        if complete:
            raise ValueError(f"{stage_dir} was made with other settings ({', '.join(changed)} differ); delete it "
                             "(and the stages after it) or choose another output.dir")
        log(f"{os.path.basename(stage_dir)}: discarding its unfinished output, made with other settings "
            f"({', '.join(changed)} differ)")
        _discard(stage_dir)
    os.makedirs(stage_dir, exist_ok=True)
    atomic_write_text(path, json.dumps(fingerprint, indent=1, sort_keys=True))


DISCARDED = ".discarded"
"""Suffix of a stage directory on its way out (``_discard``); one a killed run left is removed when
the next run starts."""


def _discard(directory: str) -> None:
    """Remove a stage's directory in one step: renamed aside, then deleted. Deleted in place, a run
    killed part-way could leave the directory without its stage.json but with its tasks' completion
    markers, and the next run took it for a new stage whose tasks were done (their shards gone, or
    made with the old settings)."""
    aside = directory + DISCARDED
    _remove(aside)
    os.rename(directory, aside)
    shutil.rmtree(aside)


def _remove_discarded(out: str) -> None:
    """What a run killed while discarding a stage left of it (``_discard``): only the names this
    pipeline's folders have (``NN-STAGE``, ``tokenized``), so nothing else of ``out`` is touched."""
    for pattern in ("[0-9][0-9]-*", "tokenized"):
        for path in glob.glob(os.path.join(glob.escape(out), pattern + DISCARDED)):
            _remove(path)


def _remove(path: str) -> None:
    """Delete ``path``, a folder or anything else, if it exists."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: damaged ({exc}); delete its stage directory and run again") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: damaged (not a JSON object); delete its stage directory and run again")
    return value


def _run_stage(ctx: Context, name: str, stage_dir: str, fingerprint: dict, body: Callable[[], dict], log) -> dict:
    """Run ``body`` unless the stage's stats.json says it already completed; write stats.json last."""
    stats_path = os.path.join(stage_dir, "stats.json")
    _check_fingerprint(stage_dir, fingerprint, os.path.isfile(stats_path), log)
    if os.path.isfile(stats_path):
        stats = _read_json(stats_path)
        if "docs_out" not in stats:
            raise ValueError(f"{stats_path}: damaged (no docs_out); delete its stage directory and run again")
        _refuse_empty_stage(name, stage_dir, stats)  # one finished by a version that let it through
        log(f"{name}: already complete ({stats['docs_out']} documents)")
        return stats
    start = time.perf_counter()
    stats = {"stage": name, **body()}
    _refuse_empty_stage(name, stage_dir, stats)
    stats["seconds"] = round(time.perf_counter() - start, 3)
    atomic_write_text(stats_path, json.dumps(stats, indent=1, sort_keys=True))
    log(summary_line(stats))
    return stats


def _refuse_empty_stage(name: str, stage_dir: str, stats: dict) -> None:
    """A stage that dropped every document leaves the later stages and the tokenizer nothing: stop
    there, naming its drops, rather than finish a run that curated an empty corpus. Its folder goes,
    as the input's does, so the run with corrected settings starts it afresh."""
    if name == "input" or not stats.get("docs_in") or stats["docs_out"]:
        return
    _discard(stage_dir)
    dropped = ", ".join(f"{n} {reason}" for reason, n in sorted(stats.get("dropped", {}).items()))
    raise ValueError(f"{name}: dropped all {stats['docs_in']} documents ({dropped}); loosen the {name} "
                     f"settings (override one with --{name}.FIELD VALUE) and run again")


def summary_line(stats: dict) -> str:
    done, bad = changes(stats), sum(stats.get("bad_records", {}).values())
    return (f"{stats['stage']}: {stats['docs_in']} -> {stats['docs_out']} documents, "
            f"{stats['bytes_out'] / 1e6:.2f} MB in {stats['seconds']:.1f} s"
            + (f"; {done}" if done else "") + (f"; {bad} bad records (see stats.json)" if bad else ""))


def run_pipeline(cfg: CurateConfig, progress: bool = False, log=print) -> dict:
    """Run every stage of ``cfg``; returns {"stages": [stats, ...], "shards": final shards, "blend": path or None}."""
    cfg = _absolute_paths(cfg)
    out = cfg.output.dir
    made = not os.path.lexists(out)
    os.makedirs(out, exist_ok=True)
    _remove_discarded(out)
    executor = make_executor(cfg.executor.kind, cfg.executor.workers, cfg.executor.ray_address)
    ctx = Context(cfg, executor, progress)
    try:
        in_dir = os.path.join(out, "00-input")
        fingerprint = {"rules": RULES, "inputs": [_file_facts(p) for p in cfg.input.paths], "format": cfg.output.format,
                       "strict": cfg.strict, **{k: v for k, v in dataclasses.asdict(cfg.input).items() if k != "paths"}}
        all_stats = [_run_stage(ctx, "input", in_dir, fingerprint, lambda: run_ingest(ctx, in_dir), log)]
        shards = list_shards(in_dir)
        for k, name in enumerate(cfg.stages, 1):
            stage_dir = os.path.join(out, f"{k:02d}-{name}")
            fingerprint = {"stage": name, "upstream": _digest(fingerprint),
                           "inputs": [os.path.basename(s) for s in shards],
                           "options": dataclasses.asdict(getattr(cfg, name)), "files": _stage_files(cfg, name)}
            all_stats.append(_run_stage(ctx, name, stage_dir, fingerprint,
                                        lambda: RUNNERS[name](ctx, shards, stage_dir), log))
            shards = list_shards(stage_dir)
    except BaseException:
        if made and not os.listdir(out):  # a run refused before it wrote anything leaves no empty folder
            os.rmdir(out)
        raise
    finally:
        executor.close()
    blend = tokenize_and_blend(cfg, shards, _digest(fingerprint), log) if cfg.preprocess.tokenizer else None
    write_report(out, all_stats)
    return {"stages": all_stats, "shards": shards, "blend": blend}


def _stage_files(cfg: CurateConfig, name: str) -> list:
    """The files a stage reads besides its input shards: retrained or edited, they make it stale."""
    if name == "quality":
        return [_file_facts(cfg.quality.model)]
    if name == "decontaminate":
        return [_file_facts(t) for t in cfg.decontaminate.tasks]
    return []


def _absolute_paths(cfg: CurateConfig) -> CurateConfig:
    """The config with absolute paths: workers (Ray's above all) need not share our directory."""
    absolute = os.path.abspath
    return dataclasses.replace(
        cfg, input=dataclasses.replace(cfg.input, paths=[absolute(p) for p in cfg.input.paths]),
        output=dataclasses.replace(cfg.output, dir=absolute(cfg.output.dir)),
        quality=dataclasses.replace(cfg.quality, model=cfg.quality.model and absolute(cfg.quality.model)),
        decontaminate=dataclasses.replace(cfg.decontaminate, tasks=[absolute(t) for t in cfg.decontaminate.tasks]))


def _with_documents(shards: list[str]) -> list[str]:
    """The shards that hold a document: preprocess refuses an input file without one, which stopped
    the run after every stage had finished; an empty jsonl shard reads as no documents."""
    import pyarrow.parquet as pq

    return [s for s in shards if not s.endswith(".parquet") or pq.ParquetFile(s).metadata.num_rows]


def _remove_unfinished(dataset: str) -> None:
    """What a tokenizing step killed outright (kill -9 leaves no cleanup) put under ``dataset``: its
    temporary files, as large as the shard, and a ``.bin`` or ``.idx`` already put in place, which
    preprocess, never replacing a shard, refused as another run's on every rerun after the whole
    corpus was tokenized again. The folder is this run's (its stage.json matched)."""
    for path in glob.glob(f"{glob.escape(dataset)}.*"):
        os.remove(path)


def tokenize_and_blend(cfg: CurateConfig, shards: list[str], upstream: str, log) -> str:
    """Tokenize the curated shards into OUT/tokenized and write OUT/blend.yaml for `megazero train`;
    ``upstream`` is the last stage's digest, so shards tokenized from another run's documents or with
    another tokenizer are never taken for these."""
    from data_pipeline.preprocess import output_prefix_for, preprocess
    from data_pipeline.shard_origin import origin_path

    out = cfg.output.dir
    prefix = os.path.join(out, "tokenized", "curated")
    dataset = output_prefix_for(prefix, cfg.input.text_field)
    fingerprint = {"upstream": upstream, "tokenizer": _file_facts(cfg.preprocess.tokenizer),
                   "text_field": cfg.input.text_field}
    # finished once its tokenizer record, written last, is there (``preprocess``)
    done = os.path.isfile(f"{dataset}.idx") and os.path.isfile(origin_path(dataset))
    _check_fingerprint(os.path.dirname(prefix), fingerprint, done, log)
    if not done:
        _remove_unfinished(dataset)
        stats = preprocess(_with_documents(shards), prefix, cfg.preprocess.tokenizer, (cfg.input.text_field,),
                           workers=cfg.preprocess.workers)
        log(f"preprocess: {stats.summary()}")
    blend = os.path.join(out, "blend.yaml")
    rel = os.path.relpath(dataset, out)
    # dumped by YAML, not formatted by hand: 1e-05 written as it prints is a string to a YAML reader
    datasets = yaml.safe_dump({"datasets": [[cfg.preprocess.weight, rel]]}, default_flow_style=None)
    atomic_write_text(blend, f"# train on it: megazero train CONFIG --data.blend_preset {blend} "
                             f"--data.blend_root {out}\n{datasets}")
    log(f"wrote {blend}")
    return blend
