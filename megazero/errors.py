"""Errors meant for the person running megazero, not for a debugger.

The command line prints a ``UserError`` as one line (no traceback) and exits non-zero; anything
else is a bug and keeps its traceback.
"""

import contextlib
import signal


class UserError(Exception):
    """Something the user can fix: bad input, a missing file, an impossible layout.

    ``agreed``: raised on every rank of a launch, rank 0 among them, once the ranks agreed on it: each
    raises this same line, but for a rank it names, which raises the error it met. ``megazero train``
    has rank 0 alone print it (a world of 8 printed it 8 times)."""

    def __init__(self, *args, agreed: bool = False) -> None:
        super().__init__(*args)
        self.agreed = agreed


@contextlib.contextmanager
def said_in_one_line(*kinds: type[Exception]):
    """Raise errors of ``kinds`` as a ``UserError`` of their message: for a lower layer's errors
    (``parallel.launch.LaunchError``) whose message already names the fix, and which cannot import
    this module to raise one itself."""
    try:
        yield
    except kinds as exc:
        raise UserError(str(exc)) from None


class ConfigError(UserError):
    """The configuration is invalid; the message names the field and the fix."""


def utf8_text(text: str, what: str) -> str:
    """``text`` (a command-line argument, or standard input) where it is valid UTF-8: Python keeps
    undecodable bytes of argv as lone surrogates, which a tokenizer rejects with a traceback."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        byte = ord(text[exc.start]) - 0xDC00 if 0xDC80 <= ord(text[exc.start]) <= 0xDCFF else None
        found = f"byte 0x{byte:02x}" if byte is not None else f"character {text[exc.start]!r}"
        raise UserError(f"{what}: not valid UTF-8 text ({found} at position {exc.start})") from None
    return text


class Terminated(KeyboardInterrupt):
    """A stop signal (SIGTERM; SIGUSR1 too while a run starts), raised where the command is, as Ctrl-C
    is: a scheduler's time limit or a cancelled job then runs the cleanup a Ctrl-C runs (a shard being
    written is removed, not left half written under a temporary name; a run's directory lock is
    released), where the signal's default ended the process on the spot."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signum


def raise_terminated(signum, frame) -> None:
    """A signal handler: raise ``Terminated`` for ``signum``."""
    raise Terminated(signum)
