"""`megazero tokenizer train|encode`: train a SentencePiece model, or encode text with any tokenizer."""

from __future__ import annotations

import os
import sys

from data_pipeline.paths import empty_path_problem, listed_twice, output_folder_problem
from megazero.errors import UserError, utf8_text


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "tokenizer", help="Train a SentencePiece tokenizer, or encode text with a SentencePiece or tokenizer.json model",
        description="Train a byte-fallback SentencePiece tokenizer from text or jsonl files, or encode text "
                    "with a SentencePiece .model or a Hugging Face tokenizer.json.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True

    train = actions.add_parser("train", help="Train a SentencePiece model (BPE or unigram, byte fallback)")
    train.add_argument("--input", nargs="+", required=True,
                       help="Text files (one document per line), .jsonl/.jsonl.gz/.jsonl.zst or .parquet files")
    train.add_argument("--json-key", default="text",
                       help="Key of the text in jsonl records, or its column in parquet files (default: text)")
    train.add_argument("--model-prefix", required=True, help="Writes PREFIX.model and PREFIX.vocab")
    train.add_argument("--vocab-size", type=int, default=32000, help="Vocabulary size (default: 32000)")
    train.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe", help="Algorithm (default: bpe)")
    train.add_argument("--max-sentences", type=int, default=2_000_000,
                       help="Lines sampled for training, more than 100 (default: 2000000)")
    train.add_argument("--seed", type=int, default=0,
                       help="Seed of the sample of lines, when the input has more than --max-sentences (default: 0)")
    train.set_defaults(func=run_train)

    encode = actions.add_parser("encode", help="Print the token ids of some text")
    encode.add_argument("--tokenizer", required=True, help="A SentencePiece .model or a tokenizer.json")
    encode.add_argument("text", nargs="?", help="Text to encode (default: read standard input)")
    encode.set_defaults(func=run_encode)


INT32_MAX = 2**31 - 1
MIN_SENTENCES = 101
"""SentencePiece samples more than 100 lines or none (its own check, worded as an internal error)."""


def check_vocab_flag(vocab_size: int) -> None:
    """``--vocab-size`` within what SentencePiece counts (32 bits), checked before any text is read:
    its own "cannot parse as int" comes only once the corpus is collected."""
    if vocab_size > INT32_MAX:
        raise UserError(f"--vocab-size: must be at most {INT32_MAX} (SentencePiece counts in 32 bits), got {vocab_size}")


def run_train(args) -> int:
    from data_pipeline.tokenizer import read_texts, train_sentencepiece

    check_vocab_flag(args.vocab_size)
    if not MIN_SENTENCES <= args.max_sentences <= INT32_MAX:
        raise UserError(f"--max-sentences: must be between {MIN_SENTENCES} and {INT32_MAX}, got {args.max_sentences}")
    if not os.path.basename(args.model_prefix):
        raise UserError(f"--model-prefix {args.model_prefix}: names a folder; give a path and a file name stem, "
                        "e.g. DIR/tokenizer")
    problem = output_folder_problem(args.model_prefix)
    if problem:
        raise UserError(f"--model-prefix {args.model_prefix}: {problem}; choose another --model-prefix")
    _check_inputs(args.input, args.json_key)
    repeat = listed_twice(("--input", name) for name in args.input)
    if repeat:
        raise UserError(f"{repeat}; its text would count twice in the pieces' frequencies (list it once)")
    existing = [args.model_prefix + ext for ext in (".model", ".vocab") if os.path.exists(args.model_prefix + ext)]
    if existing == [args.model_prefix + ".vocab"]:
        raise UserError(f"{existing[0]}: exists without its .model (what a run killed as it put its files in place "
                        "leaves); remove it or choose another --model-prefix")
    if existing:
        raise UserError(f"{existing[0]}: exists (data and checkpoints record the tokenizer they were made with); "
                        "choose another --model-prefix or remove it first")
    try:
        path = train_sentencepiece(read_texts(args.input, args.json_key), args.model_prefix, args.vocab_size,
                                   args.model_type, args.max_sentences, seed=args.seed)
    except (ValueError, OSError, RuntimeError) as exc:
        raise UserError(str(exc)) from None
    print(f"wrote {path} ({args.vocab_size} pieces, {args.model_type}, byte fallback)")
    return 0


def _check_inputs(names: list[str], json_key: str) -> None:
    """Every --input is a file that opens as its name says, and a file read as text does not open with a
    JSON record, checked before any is read: training reads them in order, so a typo in the last of
    many would otherwise be found after reading all the rest."""
    from data_pipeline.sources import JSONL_SUFFIXES, PARQUET_SUFFIXES, check_compression, iter_lines, missing_columns
    from data_pipeline.tokenizer import is_record_of, json_lines_named_as_text

    for name in names:
        empty = empty_path_problem(name, "input file", "give a text or .jsonl file")
        if empty:
            raise UserError(f"--input: {empty}")
        if os.path.isdir(name):
            raise UserError(f"--input {name}: is a folder; give the text or .jsonl files in it")
        if not os.path.exists(name):  # a pipe (``<(zcat ...)``) is no regular file, but it is an input
            raise UserError(f"--input {name}: no such file")
        try:
            check_compression(name)
            missing, columns = missing_columns(name, (json_key,))
            if missing:
                raise ValueError(f"{name}: no column {json_key!r} (columns: {columns}); choose one with --json-key")
            # a pipe is read once, by training
            if os.path.isfile(name) and not name.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES):
                _, first = next(iter_lines(name), (0, b""))
                if is_record_of(first, json_key):
                    raise ValueError(json_lines_named_as_text(name, json_key))
        except (ValueError, OSError) as exc:
            raise UserError(f"--input {exc}") from None


def run_encode(args) -> int:
    from data_pipeline.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except (ValueError, OSError) as exc:
        raise UserError(str(exc)) from None
    if args.text is not None:
        text = utf8_text(args.text, "TEXT")
    else:
        text = utf8_text(sys.stdin.buffer.read().decode("utf-8", "surrogateescape"), "standard input")
    print(" ".join(map(str, tokenizer.encode(text))))
    return 0
