"""`megazero convert`: Convert checkpoints between megazero and Hugging Face formats."""

from megazero.errors import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser("convert", help="Convert checkpoints between megazero and Hugging Face formats (not built yet)",
                                   description="Convert checkpoints between megazero and Hugging Face formats. Not built yet: this command only says so.")
    parser.set_defaults(func=run)


def run(args) -> int:
    raise UserError("'megazero convert' is not implemented yet in this version")
