"""A small real corpus that every machine already has: the Python standard library's own source.

No download, no licence question, a few MB of varied text (code, docstrings, comments), found
through ``sysconfig``. The selection is deterministic for a given Python: test suites and
third-party packages are skipped, and the rest are taken in the order of a hash of their path
relative to the stdlib root (so the budget samples every package rather than the first ones
alphabetically) until the byte budget is spent.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig

from data_pipeline.tokenizer import read_texts, train_sentencepiece

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3", "turtledemo"}


def stdlib_files(root: str | None = None) -> list[str]:
    """Relative paths of the stdlib's .py files in hash order, without tests and installed packages."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        rel_dir = os.path.relpath(dirpath, root)
        found += [os.path.normpath(os.path.join(rel_dir, f)) for f in filenames if f.endswith(".py")]
    return sorted(found, key=lambda rel: hashlib.sha1(rel.replace(os.sep, "/").encode()).hexdigest())


def write_stdlib_jsonl(path: str, max_bytes: int = 4_000_000, root: str | None = None) -> tuple[int, int]:
    """Write ``{"text", "path"}`` records to ``path`` (atomically); returns (documents, bytes)."""
    root = root or sysconfig.get_paths()["stdlib"]
    docs = total = 0
    tmp = f"{path}.tmp-{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(tmp, "w", encoding="utf-8") as out:
        for rel in stdlib_files(root):
            try:
                with open(os.path.join(root, rel), encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue  # a few stdlib files are deliberately not utf-8 (encoding tests)
            size = len(text.encode("utf-8"))
            if not text.strip() or total + size > max_bytes:
                continue
            out.write(json.dumps({"text": text, "path": rel.replace(os.sep, "/")}) + "\n")
            docs, total = docs + 1, total + size
    os.replace(tmp, path)
    return docs, total


def build_demo_corpus(out_dir: str, max_bytes: int = 4_000_000, vocab_size: int = 4096) -> dict:
    """The demo jsonl, a SentencePiece tokenizer trained on it, and its tokenized shard."""
    from data_pipeline.preprocess import preprocess

    jsonl = os.path.join(out_dir, "stdlib.jsonl")
    docs, nbytes = write_stdlib_jsonl(jsonl, max_bytes)
    model = train_sentencepiece(read_texts([jsonl]), os.path.join(out_dir, "tokenizer"), vocab_size,
                                max_sentences=200_000)
    prefix = os.path.join(out_dir, "stdlib")
    stats = preprocess([jsonl], prefix, model, workers=min(2, os.cpu_count() or 1))
    return {"jsonl": jsonl, "documents": docs, "bytes": nbytes, "tokenizer": model,
            "data_prefix": f"{prefix}_text_document", "tokens": stats.tokens}
