"""Subcommands that are specified but not built yet: each says so plainly instead of failing oddly."""

from __future__ import annotations

from megazero.errors import UserError


def register_planned(subparsers, name: str, summary: str) -> None:
    parser = subparsers.add_parser(name, help=f"{summary} (not built yet)",
                                   description=f"{summary}. Not built yet: this command only says so.")

    def run(args) -> int:
        raise UserError(f"'megazero {name}' is not implemented yet in this version")

    parser.set_defaults(func=run)
