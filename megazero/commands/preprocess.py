"""`megazero preprocess`: tokenize jsonl, parquet or Hugging Face datasets into Megatron-format shards."""

from __future__ import annotations

import os
import sys

from data_pipeline.paths import empty_path_problem, inside_another, listed_twice, output_folder_problem, output_inside
from megazero.errors import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "preprocess", help="Tokenize jsonl, parquet or Hugging Face datasets into Megatron-format .bin/.idx shards",
        description="Tokenize documents into PREFIX_KEY_document.bin/.idx shards, byte-compatible with "
                    "Megatron's indexed dataset, appending an end-of-document token to each document. "
                    "With --merge, join existing shards into one instead.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", nargs="+", action="extend", metavar="PATH",
                        help="jsonl files (.jsonl, .jsonl.gz, .jsonl.zst), .parquet files, or a Hugging Face "
                             "dataset (a save_to_disk directory, read offline, or a name for load_dataset)")
    source.add_argument("--merge", nargs="+", action="extend", metavar="PREFIX",
                        help="Shard prefixes to join, in this order")
    parser.add_argument("--output-prefix", required=True,
                        help="Output prefix; preprocessing writes PREFIX_KEY_document.bin/.idx per json key, "
                             "merging writes PREFIX.bin/.idx")
    parser.add_argument("--tokenizer", help="A SentencePiece .model or a Hugging Face tokenizer.json")
    parser.add_argument("--json-keys", nargs="+", action="extend", default=None,
                        help="Fields to tokenize (default: text)")
    parser.add_argument("--workers", type=int, default=1, help="Tokenizing processes (default: 1)")
    parser.add_argument("--batch-size", type=int, default=256, help="Documents per work unit (default: 256)")
    parser.add_argument("--no-eod", action="store_true", help="Do not append the end-of-document token")
    parser.add_argument("--hf-split", default=None,
                        help="Split of a Hugging Face dataset with several (default: train)")
    parser.add_argument("--no-progress", action="store_true", help="No progress bar")
    parser.add_argument("--skip-bad-records", action="store_true",
                        help="Leave out records whose field is not a string, malformed json lines and lines that "
                             "are not UTF-8, counting them by reason in the summary (default: such a record "
                             "is an error naming its file and line, row or index)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from data_pipeline.indexed import merge_shards
    from data_pipeline.preprocess import output_prefix_for, preprocess
    from data_pipeline.sources import reads_as_dataset

    if args.merge:
        given = [flag for flag, value, default in (
            ("--tokenizer", args.tokenizer, None), ("--json-keys", args.json_keys, None), ("--workers", args.workers, 1),
            ("--batch-size", args.batch_size, 256), ("--no-eod", args.no_eod, False),
            ("--skip-bad-records", args.skip_bad_records, False)) if value != default]
        if given:
            raise UserError(f"--merge joins shards as they are, so {', '.join(given)} would change nothing; "
                            "leave them out (they apply to --input)")
    else:
        for flag, value in (("--workers", args.workers), ("--batch-size", args.batch_size)):
            if value < 1:
                raise UserError(f"{flag}: {value} must be at least 1")
    if args.hf_split is not None and not any(reads_as_dataset(name) for name in args.input or ()):
        raise UserError(f"--hf-split {args.hf_split}: picks the split of a Hugging Face dataset input, and none is "
                        "given (files are read whole, --merge joins shards); leave the flag out")
    _check_output_dir(args.output_prefix)
    _check_json_keys(args)
    _check_no_repeats(args)
    _check_outputs_absent(args)
    try:
        if args.merge:
            merged = merge_shards(args.merge, args.output_prefix, replace=False)
            print(f"merged {len(args.merge)} shards into {args.output_prefix}: {len(merged)} documents, "
                  f"{merged.num_tokens} tokens")
            return 0
        if not args.tokenizer:
            raise UserError("--tokenizer is required to preprocess (a SentencePiece .model or a tokenizer.json)")
        stats = preprocess(args.input, args.output_prefix, args.tokenizer, tuple(args.json_keys), args.workers,
                           args.batch_size, not args.no_eod, args.hf_split,
                           progress=not args.no_progress and sys.stderr.isatty(),
                           skip_bad_records=args.skip_bad_records)
    except (ValueError, OSError, ImportError) as exc:
        raise UserError(str(exc)) from None
    for key in args.json_keys:
        print(f"wrote {output_prefix_for(args.output_prefix, key)}.bin/.idx")
    print(stats.summary())
    return 0


def _check_output_dir(prefix: str) -> None:
    """The shards' directory must be there or makeable, and writable, said before any input is read
    (``output_folder_problem``); a prefix naming a folder (``out/``, or an existing folder) would
    write hidden files into it, and so would an empty one (an unset variable), into the current folder."""
    empty = empty_path_problem(prefix, "shard", "give a path and file-name prefix, e.g. data/corpus")
    if empty:
        raise UserError(f"--output-prefix: {empty}")
    if prefix.endswith(("/", os.sep)) or os.path.isdir(prefix):
        raise UserError(f"--output-prefix {prefix}: names a folder; give a path and file-name prefix inside it, "
                        f"e.g. {os.path.join(prefix, 'corpus')}")
    problem = output_folder_problem(prefix)
    if problem:
        raise UserError(f"--output-prefix {prefix}: {problem}")


def _check_json_keys(args) -> None:
    """The fields to tokenize (``text`` when none is given): an empty name, which no record has, was
    found only as the first record was read; a field listed twice would write its shard twice."""
    args.json_keys = args.json_keys or ["text"]
    if "" in args.json_keys:
        raise UserError("--json-keys: an empty field name names no field of a record; give the field to tokenize, "
                        "e.g. --json-keys text")
    if len(set(args.json_keys)) < len(args.json_keys):
        raise UserError(f"--json-keys {' '.join(args.json_keys)}: a field is listed twice; list each once")


def _check_no_repeats(args) -> None:
    """An input named twice (however spelled), or named beside a folder that holds it, would be read
    twice, its documents trained on twice; a merge into one of its own shards would replace that
    shard; shards written into an input folder would make that folder unreadable as input (a folder
    of shards is no folder of .jsonl/.parquet files). All are refused before anything is read or
    written."""
    flag, names = ("--merge", args.merge) if args.merge else ("--input", args.input)
    repeat = listed_twice(((flag, name) for name in names), key=lambda name: _resolved(name, shard=bool(args.merge)))
    repeat = repeat or (None if args.merge else inside_another(("--input", name) for name in names))
    if repeat:
        raise UserError(f"{repeat}; its documents would be trained on twice (list it once; a blend's weights sample "
                        "a dataset more often)")
    folder = None if args.merge else output_inside(args.output_prefix, names)
    if folder:
        raise UserError(f"--output-prefix {args.output_prefix}: inside the input folder {folder}, whose next read "
                        "would take these shards for input; write them outside it")
    if args.merge and _resolved(args.output_prefix, shard=True) in {_resolved(name, shard=True) for name in args.merge}:
        raise UserError(f"--output-prefix {args.output_prefix} is one of the --merge shards; give a new prefix")


def _resolved(name: str, shard: bool):
    """One value per file, links followed: a shard prefix stands for its ``.bin``."""
    from data_pipeline.paths import file_identity
    from data_pipeline.shard_files import shard_identity

    return shard_identity(name) if shard else file_identity(name)


def _check_outputs_absent(args) -> None:
    """A run writes a ``.bin``, ``.idx`` and tokenizer record per output shard; one already there would
    be replaced without a word and the shard it belongs to lost, so it is refused before any input is read."""
    from data_pipeline.shard_files import bin_path, idx_path
    from data_pipeline.preprocess import output_prefix_for
    from data_pipeline.shard_origin import origin_path

    prefix = args.output_prefix
    for shard in [prefix] if args.merge else [output_prefix_for(prefix, key) for key in args.json_keys]:
        there = [path for path in (bin_path(shard), idx_path(shard), origin_path(shard)) if os.path.lexists(path)]
        if there and os.path.lexists(idx_path(shard)):  # a shard
            raise UserError(f"{there[0]}: already exists; give a new --output-prefix or remove it first")
        if there:  # part of one, named whole: removed one file at a time, each was refused by a run of its own
            raise UserError(f"{', '.join(there)}: already exist{'s' if len(there) == 1 else ''} without the "
                            f"shard's .idx (what a run killed as it put its files in place leaves); give a new "
                            f"--output-prefix or remove {'it' if len(there) == 1 else 'them'} first")
