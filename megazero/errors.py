"""Errors meant for the person running megazero, not for a debugger.

The command line prints a ``UserError`` as one line (no traceback) and exits non-zero; anything
else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Something the user can fix: bad input, a missing file, an impossible layout."""


class ConfigError(UserError):
    """The configuration is invalid; the message names the field and the fix."""
