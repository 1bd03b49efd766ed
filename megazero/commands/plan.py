"""`megazero plan`: Suggest a tp x pp x dp layout and ZeRO stage for a model and a cluster."""

from megazero.commands.planned import register_planned


def register(subparsers) -> None:
    register_planned(subparsers, "plan", "Suggest a tp x pp x dp layout and ZeRO stage for a model and a cluster")
