"""`megazero convert`: Convert checkpoints between megazero and Hugging Face formats."""

from megazero.commands.planned import register_planned


def register(subparsers) -> None:
    register_planned(subparsers, "convert", "Convert checkpoints between megazero and Hugging Face formats")
