"""Where an output path can be made: the checks every command runs on a path it will create before it
reads any input, so a path that cannot be made is refused while nothing is lost (creating the folders
late fails with an errno that names no option)."""

from __future__ import annotations

import os


def nearest_existing(path: str) -> str:
    """``path`` made absolute if it exists, else its nearest existing ancestor."""
    here = os.path.abspath(path)
    while not os.path.lexists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    return here


def file_in_the_way(path: str) -> str | None:
    """The file standing where ``path``'s folder or a folder above it should be, if one does, else None."""
    here = nearest_existing(os.path.dirname(os.path.abspath(path)))
    return None if os.path.isdir(here) else here
