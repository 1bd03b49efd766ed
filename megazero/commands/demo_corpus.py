"""`megazero demo-corpus OUT_DIR`: a small real corpus, its tokenizer and its shard, with no network."""

from __future__ import annotations

import math
import os

from megazero.commands.tokenizer import check_vocab_flag
from megazero.errors import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo-corpus", help="Build the offline demo corpus (Python's standard library) and its tokenizer",
        description="Write the Python standard library's own source files as OUT_DIR/stdlib.jsonl, train a "
                    "SentencePiece tokenizer on it (OUT_DIR/tokenizer.model) and tokenize it into "
                    "OUT_DIR/stdlib_text_document.bin/.idx. Needs no network; takes seconds.")
    parser.add_argument("out_dir", help="Directory to write into")
    parser.add_argument("--max-mb", type=float, default=4.0, help="Text to collect, in MB (default: 4)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="Tokenizer vocabulary (default: 4096)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from data_pipeline.demo_corpus import build_demo_corpus
    from data_pipeline.paths import empty_path_problem, file_in_the_way

    empty = empty_path_problem(args.out_dir, "folder", "give a folder to build the demo corpus in")
    if empty:
        raise UserError(f"OUT_DIR: {empty}")
    if not (math.isfinite(args.max_mb) and args.max_mb > 0):
        raise UserError(f"--max-mb: must be a positive number of MB, got {args.max_mb}")
    check_vocab_flag(args.vocab_size)
    blocking = args.out_dir if os.path.isfile(args.out_dir) else file_in_the_way(os.path.join(args.out_dir, "x"))
    if blocking:
        raise UserError(f"{args.out_dir}: {blocking} is a file, not a folder; give a folder to build the demo corpus in")
    try:
        built = build_demo_corpus(args.out_dir, int(args.max_mb * 1e6), args.vocab_size)
    except (ValueError, OSError) as exc:
        raise UserError(str(exc)) from None
    print(f"{built['jsonl']}: {built['documents']} files, {built['bytes'] / 1e6:.1f} MB")
    print(f"tokenizer: {built['tokenizer']}")
    print(f"data: {built['data_prefix']} ({built['tokens']} tokens); train with data.blend: [[1.0, {built['data_prefix']}]]")
    return 0
