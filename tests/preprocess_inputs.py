"""What the preprocessing tests share: a jsonl corpus with a small SentencePiece model trained on
it (made once per test module), and the check that the command line refused an input in one line."""

from __future__ import annotations

import json
from pathlib import Path

from data_pipeline.demo_corpus import write_stdlib_jsonl
from data_pipeline.tokenizer import read_texts, train_sentencepiece
from megazero.cli import main


def make_inputs(root: Path) -> dict:
    """The corpus (``jsonl``, its ``records``) and a 500-piece tokenizer (``model``) under ``root``."""
    jsonl = str(root / "docs.jsonl")
    write_stdlib_jsonl(jsonl, max_bytes=200_000)
    with open(jsonl) as f:
        records = [json.loads(line) for line in f]
    model = train_sentencepiece(read_texts([jsonl]), str(root / "tok"), 500, max_sentences=30_000)
    return {"root": root, "jsonl": jsonl, "records": records, "model": model}


def refused(argv: list[str], capsys, *words: str) -> None:
    """The CLI refused ``argv`` with status 2 and one line naming ``words``, no traceback."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert all(w in err for w in words), err
