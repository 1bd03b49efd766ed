"""`megazero tokenizer`: Train a SentencePiece tokenizer, or encode text with a SentencePiece or tokenizer.json model."""

from megazero.errors import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser("tokenizer", help="Train a SentencePiece tokenizer, or encode text with a SentencePiece or tokenizer.json model (not built yet)",
                                   description="Train a SentencePiece tokenizer, or encode text with a SentencePiece or tokenizer.json model. Not built yet: this command only says so.")
    parser.set_defaults(func=run)


def run(args) -> int:
    raise UserError("'megazero tokenizer' is not implemented yet in this version")
