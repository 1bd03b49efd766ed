"""The ``megazero`` command: one entry point whose subcommands live in ``megazero/commands``.

Each subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``func``. User errors (``UserError``) print as one line and exit with status 2; anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import signal
import sys

from megazero.errors import Terminated, UserError, raise_terminated
from parallel.stop_signals import STOP_SIGNALS, started_by_torchrun

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
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    sigterm = signal.getsignal(signal.SIGTERM)
    if args.command != "train":  # training saves on a stop signal, through its own handler
        signal.signal(signal.SIGTERM, raise_terminated)
    stdout = sys.stdout
    if not (args.command == "train" and not args.help_config and not args.check):  # not a training run
        sys.stdout = _Output(stdout)
    try:
        _take_stop_signals()
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a failure is caught, not at the interpreter's exit
        return code
    except ReaderLeft:  # `megazero ... | head`: stop quietly, as a Unix tool killed by SIGPIPE does
        _discard(stdout)
        return 128 + signal.SIGPIPE
    except OutputError as exc:
        _discard(stdout)
        print(f"megazero {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except UserError as exc:
        for line in str(exc).splitlines() or [type(exc).__name__]:
            print(f"megazero {args.command}: error: {line}", file=sys.stderr)
        return 2
    except Terminated as stop:
        _stopping()
        print(f"megazero {args.command}: stopped by {signal.Signals(stop.signum).name}", file=sys.stderr)
        return 128 + stop.signum
    except KeyboardInterrupt:
        _stopping()
        print(f"megazero {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        if not started_by_torchrun():  # a worker keeps ignoring it to its exit (``_stopping``)
            signal.signal(signal.SIGTERM, sigterm)
        sys.stdout = stdout
        # what the command left in reference cycles (a trainer and its process groups, after an error
        # too) is freed now, not as the interpreter shuts down (``parallel.launch.destroy_process_group``)
        gc.collect()


def _take_stop_signals() -> None:
    """Unblock the stop signals the launcher held until the command can handle them, taking those that
    arrived meanwhile as one stop: a worker still starting when torchrun sent SIGTERM after a
    sibling's Ctrl-C exit holds both, and took the SIGTERM at training's default (it died, status -15
    beside 130) or as a second stop raised inside the first's handling. A Ctrl-C among them wins; a
    SIGTERM alone is taken as the command takes one (training's default ends the process, as
    torchrun means it to when a sibling failed)."""
    arrived = []
    held = {signum: signal.signal(signum, lambda signum, frame: arrived.append(signum))
            for signum in (signal.SIGINT, signal.SIGTERM)}
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # the held ones are taken in here
    for signum, handler in held.items():
        signal.signal(signum, handler)
    if signal.SIGINT in arrived:
        raise KeyboardInterrupt
    if signal.SIGTERM in arrived:
        signal.raise_signal(signal.SIGTERM)


def _stopping() -> None:
    """A command stopping on a signal ignores SIGTERM until it returns (a torchrun worker, to its
    exit): torchrun sends one to the workers still running once the first has exited, and a worker
    that had taken the same stop and was exiting died of it (its status -15 beside the others' 130),
    or a data command showed it as a traceback from its clean-up."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class OutputError(UserError):
    """Standard output cannot be written (a full disk, an I/O error)."""


class ReaderLeft(OutputError):
    """Standard output is a pipe whose reader has closed it."""


class _Output:
    """Standard output while a command (not a training run) prints: a failed write becomes one line
    naming standard output, or a quiet stop when the reader has left, instead of a traceback."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise _output_error(exc) from None

    def flush(self):
        try:
            self._stream.flush()
        except OSError as exc:
            raise _output_error(exc) from None

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _output_error(exc: OSError) -> OutputError:
    if isinstance(exc, BrokenPipeError):
        return ReaderLeft()
    return OutputError(f"standard output: cannot be written ({exc.strerror or exc}); free space where it goes, "
                       "or send it elsewhere")


def _discard(stream) -> None:
    """Point ``stream``'s file descriptor at the null device, so that the text still in its buffer
    does not fail again (with a message of Python's) when the interpreter flushes it at exit."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's capture)
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)


def _command_parser(parser: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``args`` chose, whose usage lists the options it takes (the
    top-level usage, ``megazero [-h] COMMAND ...``, lists none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None))
            if chosen is not None:
                return _command_parser(chosen, args)
    return parser



if __name__ == "__main__":
    sys.exit(main())
