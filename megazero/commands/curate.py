"""`megazero curate`: clean, quality-filter, deduplicate and decontaminate a corpus, then blend it.

``megazero curate run CONFIG [--section.field VALUE ...]`` runs a pipeline YAML (see
docs/curation.md); ``train-quality`` trains the fastText classifier the quality stage uses;
``demo DIR`` builds an offline demo corpus and its config.
"""

from __future__ import annotations

import os
import sys

from megazero.errors import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "curate", help="Clean, quality-filter (fastText + Pareto), deduplicate (exact, MinHash-LSH) and "
                       "decontaminate a corpus",
        description="Data curation in the Megatron-Turing NLG style: `run` a pipeline config, `train-quality` "
                    "a fastText classifier, or build the offline `demo`.")
    sub = parser.add_subparsers(dest="curate_command", metavar="ACTION")
    sub.required = True

    run = sub.add_parser("run", help="Run a curation pipeline YAML (overrides: --section.field VALUE)")
    run.add_argument("config", help="Pipeline YAML: input, output, executor, stages and their options")
    run.add_argument("--workers", type=int, help="Worker processes (overrides executor.workers)")
    run.add_argument("--executor", choices=("local", "ray"), help="Where tasks run (overrides executor.kind)")
    run.add_argument("--ray-address", help="Ray cluster address, e.g. auto (default: a local Ray instance)")
    run.add_argument("--strict", action="store_true", help="Any bad input record is fatal")
    run.add_argument("--no-progress", action="store_true", help="No progress bars")
    run.set_defaults(func=run_config, accepts_overrides=True)

    train = sub.add_parser("train-quality", help="Train the fastText quality classifier (hq vs lq)")
    train.add_argument("--hq", nargs="+", action="extend", required=True, metavar="FILE", help="High-quality documents (jsonl/parquet)")
    train.add_argument("--lq", nargs="+", action="extend", required=True, metavar="FILE", help="Low-quality documents (jsonl/parquet)")
    train.add_argument("--output", required=True, help="Where to write the model (.bin)")
    train.add_argument("--text-field", default="text", help="Field holding the text (default: text)")
    train.add_argument("--epoch", type=int, default=5, help="Training epochs (default: 5)")
    train.add_argument("--seed", type=int, default=0)
    train.set_defaults(func=train_quality)

    demo = sub.add_parser("demo", help="Build the offline demo: a corpus with planted duplicates, junk and "
                                       "a contaminated task, its quality model, tokenizer and config")
    demo.add_argument("dir", help="Directory to build it in, e.g. data/curate_demo")
    demo.set_defaults(func=build_demo)


def run_config(args) -> int:
    import yaml

    from data_pipeline.curate.config import CurateConfig, build_config
    from data_pipeline.curate.pipeline import run_pipeline
    from megazero.config.loader import parse_overrides, read_yaml, set_dotted

    raw = read_yaml(args.config, CurateConfig)
    for key, value in parse_overrides(list(args.overrides), CurateConfig):
        set_dotted(raw, key.replace("-", "_"), value)
    if raw.get("executor") is None:  # an empty section takes its defaults, as every other section does
        raw["executor"] = {}
    executor = raw["executor"] if isinstance(raw["executor"], dict) else None
    if executor is None:
        raise UserError(f"{args.config}: executor must be a mapping (kind, workers, ray_address)")
    for flag, key in ((args.workers, "workers"), (args.executor, "kind"), (args.ray_address, "ray_address")):
        if flag is not None:
            executor[key] = flag
    if args.strict:
        raw["strict"] = True
    try:
        cfg = build_config(raw)
        result = run_pipeline(cfg, progress=not args.no_progress and sys.stderr.isatty())
    except (ValueError, OSError, ImportError) as exc:
        raise UserError(str(exc)) from None
    except yaml.YAMLError as exc:  # pragma: no cover - read_yaml reports these
        raise UserError(str(exc)) from None
    print(f"curated {result['stages'][-1]['docs_out']} documents into {os.path.dirname(result['shards'][0])}; "
          f"report: {os.path.join(cfg.output.dir, 'report.md')}")
    if result["blend"]:
        print(f"train on it: megazero train CONFIG --data.blend_preset {result['blend']} "
              f"--data.blend_root {cfg.output.dir}")
    return 0


def train_quality(args) -> int:
    from data_pipeline.curate.quality import train_quality as train

    if args.epoch < 1:
        raise UserError(f"--epoch: must be 1 or more, got {args.epoch} (the model would be saved untrained)")
    try:
        stats = train(args.hq, args.lq, args.output, args.text_field, args.epoch, seed=args.seed)
    except (ValueError, OSError, ImportError) as exc:
        raise UserError(str(exc)) from None
    print(f"trained on {stats['hq']} hq and {stats['lq']} lq documents; held-out accuracy "
          f"{stats['accuracy']:.3f} on {stats['held_out']}; wrote {args.output}")
    return 0


def build_demo(args) -> int:
    from data_pipeline.curate.demo import build_demo as build

    try:
        info = build(args.dir)
    except (ValueError, OSError) as exc:
        raise UserError(str(exc)) from None
    print(f"demo corpus: {info['documents']} documents in {info['corpus']}; config {info['config']}")
    print(f"run it: megazero curate run {info['config']}")
    return 0
