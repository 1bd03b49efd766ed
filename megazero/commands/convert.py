"""`megazero convert SRC DST`: convert checkpoints between megazero, Hugging Face and Megatron-LM.

The source kind is detected from its files (``--from`` names it). Everything is written into a
temporary folder beside DST and renamed to DST at the end: on any error DST does not exist.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from data_pipeline.paths import empty_path_problem, file_in_the_way

from megazero.errors import UserError

TARGETS = ("hf", "megazero", "torch", "megatron")
LAYOUT_FLAGS = {"--tp": "parallel.tp", "--pp": "parallel.pp", "--dp": "parallel.dp", "--zero-stage": "zero.stage",
                "--virtual-stages": "parallel.virtual_stages", "--pipeline-schedule": "parallel.pipeline_schedule"}
SCHEDULE_FLAG = "--pipeline-schedule"  # a name, checked by the config's validation; the others are integers
SIZE_FLAGS = ("--tp", "--pp", "--dp", "--virtual-stages")
SOURCES = ("megazero", "hf", "megatron")
NO_TOKENIZER = "none"  # --tokenizer none: export the weights alone


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "convert", help="Convert checkpoints between megazero, Hugging Face and Megatron-LM formats",
        description="Convert SRC (a megazero checkpoint of any layout, a Hugging Face model folder, or a "
                    "Megatron-LM legacy checkpoint) into DST, streaming one tensor at a time. "
                    "--to megazero writes a consolidated checkpoint (world size 1) that `megazero train "
                    "--checkpoint.load DST` reshards into its own layout, or, given any of --tp --pp --dp "
                    "--zero-stage --virtual-stages --pipeline-schedule, one file per rank of a run with that "
                    "layout (each rank then reads only the files of its pipeline stage). --to megatron writes "
                    "Megatron-LM's legacy torch checkpoint (a release one: the model alone) for --tp x --pp.")
    parser.add_argument("src", help="Checkpoint to read: a step_* directory or its root, a folder with "
                                    "config.json, or a Megatron root / iter_* directory")
    parser.add_argument("dst", help="Path to create (must not exist): a folder, or a .safetensors file for --to torch")
    parser.add_argument("--to", choices=TARGETS, default=None,
                        help="Target format (default: hf from megazero, megazero from the others)")
    parser.add_argument("--from", dest="source", choices=SOURCES, default=None,
                        help="Source format (default: detected from SRC's files)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                        help="--to hf or megatron: weight dtype (from the fp32 master; default fp32, or to hf the "
                             "dtype of the Hugging Face model the weights were imported from)")
    parser.add_argument("--tokenizer", default=None,
                        help="--to hf: tokenizer to include (default: the source run's data.tokenizer, if present; "
                             f"{NO_TOKENIZER}: none)")
    parser.add_argument("--shard-size-gb", type=float, default=None,
                        help="--to hf: largest weight shard, in GB (default 5)")
    parser.add_argument("--reset-step", action="store_true",
                        help="--to megazero from megazero: start at step 0 with fresh optimizer state")
    layout = parser.add_argument_group("--to megazero: the layout of the run that will load DST (default: consolidated); "
                                       "--to megatron: --tp and --pp (default 1)")
    for flag, field in LAYOUT_FLAGS.items():
        if flag != SCHEDULE_FLAG:
            layout.add_argument(flag, type=int, default=None, dest=field.replace(".", "_"),
                                help=f"{field} of that run (others from the source run's config, else defaults)")
    layout.add_argument(SCHEDULE_FLAG, default=None, dest=LAYOUT_FLAGS[SCHEDULE_FLAG].replace(".", "_"),
                        help="parallel.pipeline_schedule of that run: zb-v places each rank's two chunks in a V, "
                             "so its ranks hold other stages than a loop's")
    parser.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default=None,
                        help="--to megatron (required): the layer implementation of the Megatron-LM run that will "
                             "load DST (its --transformer-impl), which names a layer's norms")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="From Megatron: the tokenizer's vocabulary, where its args record only the padded one "
                             "(padding rows are then left out)")
    parser.add_argument("--no-verify", action="store_true",
                        help="Skip the sha256 check of a megazero source's files (their presence and sizes are still checked)")
    parser.set_defaults(func=run)


def open_source(path: Path, kind, verify: bool = True, vocab_size: int | None = None):
    from megazero.convert.sources import MegazeroSource, detect

    if not path.exists():
        raise UserError(f"{path}: does not exist; check SRC")
    if not path.is_dir():
        raise UserError(f"{path}: is a file; SRC is a checkpoint folder (a state dict written by --to torch is "
                        "for other tools and is not converted back)")
    kind = kind or detect(path)
    if vocab_size is not None and kind != "megatron":
        raise UserError(f"--vocab-size: applies to a Megatron source only; {path} is a {kind} checkpoint")
    if kind == "hf":
        from megazero.convert.hf import HFSource

        return HFSource(path)
    if kind == "megatron":
        from megazero.convert.megatron import MegatronSource

        return MegatronSource(path, vocab_size)
    return MegazeroSource(path, verify=verify)


def check_flags(args) -> None:
    """Refuse numbers no conversion can use before anything is read: a group size below 1 (the
    world size computed from it would be 0 or negative, and --dp 0 would quietly mean 1), and a
    shard size that is not a positive finite number of GB (0 or less would put every tensor in a
    file of its own)."""
    for flag in SIZE_FLAGS:
        value = getattr(args, LAYOUT_FLAGS[flag].replace(".", "_"))
        if value is not None and value < 1:
            raise UserError(f"{flag}: must be 1 or more, got {value}")
    if args.shard_size_gb is not None and not (math.isfinite(args.shard_size_gb) and args.shard_size_gb > 0):
        raise UserError(f"--shard-size-gb: must be a positive number of GB, got {args.shard_size_gb}")


def run(args) -> int:
    from megazero.convert.streaming import staged

    check_flags(args)
    for name, value, what, fix in (("SRC", args.src, "checkpoint", "give the checkpoint to convert"),
                                   ("DST", args.dst, "destination", "give a new path to write")):
        empty = empty_path_problem(value, what, fix)
        if empty:
            raise UserError(f"{name}: {empty}")
    src, dst = Path(args.src), Path(args.dst)
    if os.path.lexists(dst):  # a dangling link too: the final rename would fail on it
        raise UserError(f"{dst}: already exists; give a new DST path or remove it first")
    blocking = file_in_the_way(str(dst))
    if blocking:
        raise UserError(f"{dst}: {blocking} is a file, not a folder; give another DST path")
    if dst.resolve().is_relative_to(src.resolve()):
        raise UserError(f"{dst}: inside SRC {src}; a conversion must not write into the checkpoint it reads (a "
                        "training run would take the new folder for one of its own); give a DST outside it")
    if args.to == "torch" and dst.suffix != ".safetensors":  # model or model.pt would not say what it holds
        raise UserError(f"{dst}: --to torch writes one safetensors file; name it NAME.safetensors")
    if args.vocab_size is not None and args.vocab_size < 1:
        raise UserError(f"--vocab-size: must be 1 or more, got {args.vocab_size}")
    source = open_source(src, args.source, verify=not args.no_verify, vocab_size=args.vocab_size)
    if args.no_verify and source.kind != "megazero":  # else it would be taken as done and do nothing
        raise UserError(f"--no-verify: skips the checksums of a megazero source's files; this {source.kind} "
                        "source records none, so leave the flag out")
    target = args.to or ("hf" if source.kind == "megazero" else "megazero")
    hf_only = [flag for flag, value in (("--tokenizer", args.tokenizer), ("--shard-size-gb", args.shard_size_gb))
               if value is not None]
    if hf_only and target != "hf":
        verb = "apply" if len(hf_only) > 1 else "applies"
        raise UserError(f"{', '.join(hf_only)}: {verb} to --to hf only (this conversion writes {target})")
    if args.dtype is not None and target not in ("hf", "megatron"):
        raise UserError(f"--dtype: applies to --to hf and --to megatron only (this conversion writes {target}, "
                        "whose weights stay fp32)")
    if args.reset_step and (target != "megazero" or source.kind != "megazero"):
        raise UserError("--reset-step: applies to --to megazero from a megazero checkpoint only (other sources "
                        "always start at step 0)")
    layout = {field: getattr(args, field.replace(".", "_")) for field in LAYOUT_FLAGS.values()}
    layout = {field: value for field, value in layout.items() if value is not None}
    allowed = ("parallel.tp", "parallel.pp") if target == "megatron" else tuple(LAYOUT_FLAGS.values())
    refused = [flag for flag, field in LAYOUT_FLAGS.items() if field in layout and
               (target not in ("megazero", "megatron") or field not in allowed)]
    if refused:
        also = " (a Megatron checkpoint's layout is --tp and --pp)" if target == "megatron" else \
            " (and --tp, --pp to --to megatron)" if set(refused) <= {"--tp", "--pp"} else ""
        raise UserError(f"{', '.join(refused)}: apply to --to megazero only{also}")
    if target == "megatron" and args.transformer_impl is None:
        raise UserError("--transformer-impl: give it with --to megatron, as the Megatron-LM run that loads DST has it "
                        "(local or transformer_engine): the two name a layer's norms differently, and Megatron-LM "
                        "leaves the norms of a file named for the other at their initial values without a word")
    if target != "megatron" and args.transformer_impl is not None:
        raise UserError(f"--transformer-impl: applies to --to megatron only (this conversion writes {target})")
    run_cfg = run_config(source, layout) if layout and target == "megazero" else None
    if run_cfg is not None and not args.reset_step:
        _refuse_another_ramp(source, run_cfg)
    if target == "hf":
        from megazero.convert.hf import write_hf
        from megazero.convert.hf_models import family_for

        family_for(source.cfg)  # refuse before creating anything
        from megazero.convert.hf_tokenizer import load_fitting
        from megazero.convert.sources import source_meta
        from megazero.data import not_trained_with

        path = args.tokenizer or _run_tokenizer(source)
        flag = "--tokenizer" if args.tokenizer else "the run's data.tokenizer"
        export = path is not None and args.tokenizer != NO_TOKENIZER
        tokenizer = load_fitting(path, source.cfg.vocab_size, source.cfg.seq_length, flag) if export else None
        mismatch = tokenizer is not None and not_trained_with(source_meta(source), tokenizer.tok, flag)
        if mismatch:
            raise UserError(mismatch)
        dtype = args.dtype or _hf_dtype(source)
        with staged(dst) as tmp:
            write_hf(source, tmp, dtype, tokenizer, int((args.shard_size_gb or 5.0) * 1e9))
    elif target == "megatron":
        from megazero.convert.megatron_out import layout_problem, write_megatron

        tp, pp = layout.get("parallel.tp", 1), layout.get("parallel.pp", 1)
        problem = layout_problem(source.cfg, tp, pp)
        if problem:  # before DST's temporary folder exists
            raise UserError(problem)
        with staged(dst) as tmp:
            write_megatron(source, tmp, tp, pp, args.transformer_impl, args.dtype or "fp32")
    elif target == "torch":
        from megazero.convert.targets import write_state_dict

        with staged(dst, single_file=True) as tmp:
            write_state_dict(source, tmp / dst.name)
    else:
        from megazero.convert.targets import write_megazero

        with staged(dst) as tmp:
            write_megazero(source, tmp, reset_step=args.reset_step, run=run_cfg)
    print(f"megazero convert: wrote {dst} ({target}, from {source.kind} {src})")
    return 0


def run_config(source, layout: dict):
    """The config of the run DST is laid out for: the source run's recorded config (a megazero
    source), else defaults around the source's model (the global batch made a whole number of
    micro-batches per data-parallel rank), with the layout flags applied; validated for
    the world tp x pp x dp, so a layout the model cannot take is refused (one line per problem,
    naming the field) before anything is written."""
    import copy
    import dataclasses

    from megazero.config.loader import build_dataclass, config_to_dict, set_dotted
    from megazero.config.schema import Config
    from megazero.config.validate import resolve_config
    from megazero.convert.sources import fresh_config, source_meta
    from parallel.pipeline.placement import V_SHAPED
    from parallel.pipeline.schedule import schedule_problem

    meta = source_meta(source)
    recorded = isinstance(meta.get("config"), dict)
    # a copy: the layout flags below are set into it, and the source's record stays the run's own
    raw = copy.deepcopy(meta["config"]) if recorded else config_to_dict(fresh_config(source))
    raw = {**raw, "model": dataclasses.asdict(source.cfg)}
    before = dict(raw.get("parallel") or {})
    for field, value in layout.items():
        set_dotted(raw, field, value)
    p = raw["parallel"]
    # What the source run chose for its own layout and the new one cannot take reverts to the
    # default (no flag could unset it): sequence parallelism without tp, virtual stages without pp,
    # a pipeline split or schedule made for another pipeline shape.
    if p.get("tp") == 1:
        p["sequence_parallel"], p["tp_comm"] = False, "auto"
    if p.get("pp") == 1 and "parallel.virtual_stages" not in layout:
        p["virtual_stages"] = 1
    if (p.get("pp"), p.get("virtual_stages")) != (before.get("pp"), before.get("virtual_stages")):
        p["pipeline_split"] = None
        if "parallel.pipeline_schedule" not in layout and \
                schedule_problem(p.get("pipeline_schedule", "auto"), p.get("virtual_stages", 1)):
            p["pipeline_schedule"] = "auto"
    if (p.get("pipeline_schedule") in V_SHAPED) != (before.get("pipeline_schedule") in V_SHAPED):
        p["pipeline_split"] = None  # the split was made for stages the ranks no longer hold in that order
    dp = p.get("dp") or 1
    if not recorded:  # no run chose the default batch: a multiple of dp micro-batches, as a --dp needs
        train = raw["train"]
        per_step = train["micro_batch_size"] * dp
        train["global_batch_size"] = -(-train["global_batch_size"] // per_step) * per_step
    set_dotted(raw, "parallel.dp", None)  # derived from the world by validation
    cfg = build_dataclass(Config, raw, prefix="")
    return resolve_config(cfg, p["tp"] * p["pp"] * dp)


def _refuse_another_ramp(source, run_cfg) -> None:
    """A checkpoint converted with its progress keeps its step and samples, but records DST's layout as
    its run's: a --dp that regroups a batch ramp-up's samples ahead into other steps would pass the
    resume's own check of that (``resume_checks.batch_changes``), which compares with the record. So
    the check is made here, against the source run's record."""
    import dataclasses

    from megazero.config.loader import build_dataclass
    from megazero.config.schema import Config
    from megazero.convert.sources import source_meta
    from megazero.resume_checks import batch_changes

    meta = source_meta(source)
    if not isinstance(meta.get("config"), dict) or not meta.get("step"):
        return  # no run, or none begun: no place in a ramp-up to keep
    before = build_dataclass(Config, {**meta["config"], "model": dataclasses.asdict(source.cfg)}, prefix="")
    for problem in batch_changes(before, run_cfg, int(meta.get("consumed", 0))):
        raise UserError(f"--dp {run_cfg.parallel.dp}: the checkpoint (step {meta.get('step', 0)}) {problem}; keep the "
                        f"run's dp {before.parallel.dp} until its batch ramp-up ends, or add --reset-step to start a "
                        "new run from these weights")


def _hf_dtype(source) -> str:
    """--to hf's dtype without --dtype: that of the Hugging Face model the weights were imported from
    (a bf16 model comes back bf16, as ``from_pretrained`` then loads it, not as an fp32 model), said
    in a note; fp32, the master's, for weights a run trained."""
    from megazero.convert.hf import imported_dtype

    dtype = imported_dtype(source)
    if dtype is None:
        return "fp32"
    print(f"megazero convert: note: weights written in {dtype}, the dtype of the Hugging Face model they were "
          "imported from (--dtype chooses another)", flush=True)
    return dtype


def _run_tokenizer(source):
    """The tokenizer the source run trained with, if its config names one that still exists here."""
    from megazero.convert.sources import source_meta

    meta = source_meta(source)
    path = ((meta.get("config") or {}).get("data") or {}).get("tokenizer")
    return path if path and Path(path).exists() else None
