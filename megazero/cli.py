"""The ``megazero`` command: one entry point whose subcommands live in ``megazero/commands``.

Each subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``func``. User errors (``UserError``) print as one line and exit with status 2; anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from megazero.errors import UserError

SUBCOMMANDS = ("train", "generate", "preprocess", "tokenizer", "demo_corpus", "curate", "convert", "plan")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megazero",
        description="Pretrain GPT decoders with tensor, pipeline and ZeRO data parallelism.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in SUBCOMMANDS:
        importlib.import_module(f"megazero.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        for line in str(exc).splitlines() or [type(exc).__name__]:
            print(f"megazero {args.command}: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"megazero {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
