"""`megazero plan`: Suggest a tp x pp x dp layout and ZeRO stage for a model and a cluster."""

from megazero.errors import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser("plan", help="Suggest a tp x pp x dp layout and ZeRO stage for a model and a cluster (not built yet)",
                                   description="Suggest a tp x pp x dp layout and ZeRO stage for a model and a cluster. Not built yet: this command only says so.")
    parser.set_defaults(func=run)


def run(args) -> int:
    raise UserError("'megazero plan' is not implemented yet in this version")
