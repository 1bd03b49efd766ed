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
import tempfile

from data_pipeline.paths import made_folder, written_whole
from data_pipeline.tokenizer import check_vocab_size, read_texts, train_sentencepiece

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
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with written_whole(path) as tmp, open(tmp, "w", encoding="utf-8") as out:
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
    return docs, total


DEMO_FILES = ("stdlib.jsonl", "tokenizer.model", "tokenizer.vocab", "stdlib_text_document.bin",
              "stdlib_text_document.tokenizer.json", "stdlib_text_document.idx")
"""What a build writes into its folder, in the order it is moved in: the shard's index last, since
its presence says a build finished (``scripts/pretrain_gpt.sh`` builds where it is missing)."""


def build_demo_corpus(out_dir: str, max_bytes: int = 4_000_000, vocab_size: int = 4096) -> dict:
    """The demo jsonl, a SentencePiece tokenizer trained on it, and its tokenized shard.

    Built in a temporary folder inside ``out_dir`` and moved in at the end, so a build that fails
    or is stopped leaves the folder as it was (or absent, if it was); a folder holding an earlier
    build is refused, not rebuilt over (shards and checkpoints record the tokenizer they came from
    by its digest)."""
    from data_pipeline.preprocess import preprocess

    check_vocab_size(vocab_size)  # before the corpus is collected
    there = [name for name in DEMO_FILES if os.path.exists(os.path.join(out_dir, name))]
    if there:
        raise ValueError(f"{os.path.join(out_dir, there[0])}: exists (a demo corpus was built here, and data "
                         "or checkpoints may record its tokenizer); choose another folder or remove it first")
    with made_folder(out_dir), tempfile.TemporaryDirectory(dir=out_dir, prefix=".demo-build-") as tmp:
        jsonl = os.path.join(tmp, "stdlib.jsonl")
        docs, nbytes = write_stdlib_jsonl(jsonl, max_bytes)
        model = train_sentencepiece(read_texts([jsonl]), os.path.join(tmp, "tokenizer"), vocab_size,
                                    max_sentences=200_000)
        stats = preprocess([jsonl], os.path.join(tmp, "stdlib"), model, workers=min(2, os.cpu_count() or 1))
        made = sorted(os.listdir(tmp))
        if made != sorted(DEMO_FILES):  # a file DEMO_FILES misses would be deleted with the folder
            raise RuntimeError(f"the demo build wrote {made}, not {sorted(DEMO_FILES)}")
        for name in DEMO_FILES:
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    return {"jsonl": os.path.join(out_dir, "stdlib.jsonl"), "documents": docs, "bytes": nbytes,
            "tokenizer": os.path.join(out_dir, "tokenizer.model"),
            "data_prefix": os.path.join(out_dir, "stdlib_text_document"), "tokens": stats.tokens}
