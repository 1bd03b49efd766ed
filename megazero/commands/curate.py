"""`megazero curate`: Filter a corpus: fastText quality classifier, exact and MinHash fuzzy dedup, n-gram decontamination."""

from megazero.commands.planned import register_planned


def register(subparsers) -> None:
    register_planned(subparsers, "curate", "Filter a corpus: fastText quality classifier, exact and MinHash fuzzy dedup, n-gram decontamination")
