"""`megazero curate`: Filter a corpus: fastText quality classifier, exact and MinHash fuzzy dedup, n-gram decontamination."""

from megazero.errors import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser("curate", help="Filter a corpus: fastText quality classifier, exact and MinHash fuzzy dedup, n-gram decontamination (not built yet)",
                                   description="Filter a corpus: fastText quality classifier, exact and MinHash fuzzy dedup, n-gram decontamination. Not built yet: this command only says so.")
    parser.set_defaults(func=run)


def run(args) -> int:
    raise UserError("'megazero curate' is not implemented yet in this version")
