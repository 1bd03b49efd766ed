"""The ``megazero`` command: one entry point whose subcommands live in ``megazero/commands``.

Each subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``func``. User errors (``UserError``) print as one line and exit with status 2; anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import signal
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
    if args.command != "train":  # training saves on a stop signal, through its own handler
        signal.signal(signal.SIGTERM, _terminated)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        for line in str(exc).splitlines() or [type(exc).__name__]:
            print(f"megazero {args.command}: error: {line}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"megazero {args.command}: stopped by SIGTERM", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"megazero {args.command}: interrupted", file=sys.stderr)
        return 130


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is, as Ctrl-C is: a scheduler's time limit or a cancelled
    job then runs the cleanup a Ctrl-C runs (a shard being written is removed, not left half
    written under a temporary name), where SIGTERM's default ended the process on the spot."""


def _terminated(signum, frame) -> None:
    raise Terminated


if __name__ == "__main__":
    sys.exit(main())
