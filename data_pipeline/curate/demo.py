"""An offline curation demo made from prose every Python install carries: its docs and docstrings.

``pydoc_data.topics`` holds the language reference's prose (what ``help("if")`` prints) and the
standard library's modules, classes and functions carry docstrings. From them the demo writes a
corpus with known defects planted in it: exact copies, near-duplicates (word edits, shuffled
sentences, boilerplate added, truncation), junk (symbol soup, repeated lines, fragments) and a
training document that quotes an evaluation task. It also trains a tiny quality model (docs prose
as hq, word salad as lq) and a tokenizer, so `megazero curate run configs/curate_demo.yaml`
exercises every stage and ends in a blend `megazero train` can read.
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import sysconfig
import tempfile

from data_pipeline.demo_corpus import stdlib_files

BOILERPLATE = ("\n\nThis page was generated from the project's documentation. All rights reserved. "
               "Subscribe to the newsletter for updates.")


def stdlib_prose(max_docs: int = 2000, min_chars: int = 400) -> list[str]:
    """Paragraph groups of the reference's topics, then docstrings; deterministic for a given Python."""
    from pydoc_data.topics import topics

    docs = []
    for name in sorted(topics):
        docs += _chunks(topics[name], 1500)
    root = sysconfig.get_paths()["stdlib"]
    for rel in stdlib_files(root):
        if len(docs) >= max_docs:
            break
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                text = ast.get_docstring(node)
                if text:
                    docs.append(text)
    seen, out = set(), []
    for d in docs:
        d = d.strip()
        if len(d) >= min_chars and d not in seen:
            seen.add(d)
            out.append(d)
    return out[:max_docs]


def _chunks(text: str, size: int) -> list[str]:
    """Paragraphs grouped into pieces of about ``size`` characters."""
    out, cur = [], ""
    for para in text.split("\n\n"):
        cur = f"{cur}\n\n{para}" if cur else para
        if len(cur) >= size:
            out.append(cur)
            cur = ""
    return out + ([cur] if cur else [])


def near_duplicate(text: str, kind: str, rng: random.Random) -> str:
    """A copy of ``text`` changed the way scraped copies differ."""
    if kind == "word_edits":
        words = text.split(" ")
        for i in rng.sample(range(len(words)), max(1, len(words) // 50)):
            words[i] = rng.choice(["data", "value", "the", "object", "result"])
        return " ".join(words)
    if kind == "shuffled_sentences":
        sentences = re.split(r"(?<=[.!?])\s+", text)
        if len(sentences) > 2:
            i = rng.randrange(len(sentences) - 1)
            sentences[i], sentences[i + 1] = sentences[i + 1], sentences[i]
        return " ".join(sentences)
    if kind == "boilerplate":
        return text + BOILERPLATE
    if kind == "truncation":
        return text[:int(len(text) * 0.92)]
    raise ValueError(f"unknown near-duplicate kind {kind!r}")


NEAR_KINDS = ("word_edits", "shuffled_sentences", "boilerplate", "truncation")


def junk_documents(rng: random.Random, n: int) -> list[str]:
    junk = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            junk.append(" ".join("".join(rng.choice("#$%&*@!{}[]<>|~^") for _ in range(6)) for _ in range(120)))
        elif kind == 1:
            junk.append("\n".join(["Click here to subscribe to our newsletter today"] * 40))
        else:
            junk.append("Home | About | Contact")
    return junk


def word_salad(words: list[str], rng: random.Random, n: int, length: int = 150) -> list[str]:
    return [" ".join(rng.choice(words) for _ in range(length)) for _ in range(n)]


def write_jsonl(path: str, texts: list[str], ids: list[str] | None = None) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": ids[i], "text": t} if ids else {"text": t}) + "\n")
    return path


DEMO_FILES = ("corpus.jsonl", os.path.join("tasks", "docs_qa.jsonl"), "hq.jsonl", "lq.jsonl", "quality.bin",
              "tokenizer.model", "tokenizer.vocab")


def build_demo(out_dir: str, seed: int = 0) -> dict:
    """The planted corpus, a task file, a quality model and a tokenizer in ``out_dir``. Files already
    there are refused, never replaced (a shard records the tokenizer it was made with, a finished
    quality stage the model it scored with); the demo is built in a temporary folder inside
    ``out_dir`` and moved in at the end, so a failed build leaves nothing behind."""
    from data_pipeline.curate.quality import MIN_BUCKETS, train_quality
    from data_pipeline.tokenizer import train_sentencepiece

    ours = DEMO_FILES + (() if os.path.normpath(out_dir) == DEMO_DIR else ("curate.yaml",))
    there = [name for name in ours if os.path.lexists(os.path.join(out_dir, name))]
    if there:
        raise ValueError(f"{out_dir}: already holds {', '.join(there)}; the demo does not replace files: give a new "
                         "or empty folder")
    rng = random.Random(seed)
    prose = stdlib_prose()
    if len(prose) < 200:
        raise ValueError("this Python's standard library has too little documentation for the demo")
    rng.shuffle(prose)
    hq_train, originals = prose[:150], prose[150:]
    task = originals[:20]  # an "evaluation set"; one of its passages is planted in a training document
    corpus = list(originals[20:])
    corpus += corpus[:40]  # exact copies
    corpus += [near_duplicate(t, NEAR_KINDS[i % 4], rng) for i, t in enumerate(corpus[40:120])]
    corpus += junk_documents(rng, 30)
    vocab = sorted({w for t in prose for w in t.split() if w.isalpha()})
    lq_train = word_salad(vocab, rng, 150)
    corpus += word_salad(vocab, rng, 60)  # low quality: the classifier should send most of these away
    corpus.append(corpus[0] + "\n\n" + task[0] + "\n\n" + corpus[1])  # contamination
    rng.shuffle(corpus)
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".curate-demo-") as tmp:
        hq, lq = write_jsonl(os.path.join(tmp, "hq.jsonl"), hq_train), write_jsonl(os.path.join(tmp, "lq.jsonl"), lq_train)
        write_jsonl(os.path.join(tmp, "corpus.jsonl"), corpus)
        write_jsonl(os.path.join(tmp, "tasks", "docs_qa.jsonl"), task)
        quality = train_quality([hq], [lq], os.path.join(tmp, "quality.bin"), epoch=25, seed=seed,
                                bucket=MIN_BUCKETS)  # its 40,000 word bigrams: 64 MiB, not fastText's 488
        train_sentencepiece(iter(prose), os.path.join(tmp, "tokenizer"), 2048)
        for name in DEMO_FILES:
            final = os.path.join(out_dir, name)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.replace(os.path.join(tmp, name), final)
    files = {key: os.path.join(out_dir, name) for key, name in (
        ("corpus", "corpus.jsonl"), ("task", os.path.join("tasks", "docs_qa.jsonl")), ("hq", "hq.jsonl"),
        ("lq", "lq.jsonl"))}
    return {**files, "documents": len(corpus), "quality_model": os.path.join(out_dir, "quality.bin"),
            "quality_accuracy": quality["accuracy"], "tokenizer": os.path.join(out_dir, "tokenizer.model"),
            "config": demo_config(out_dir)}


DEMO_DIR = "data/curate_demo"
DEMO_CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "curate_demo.yaml")


def demo_config(out_dir: str) -> str:
    """The config that curates the demo in ``out_dir``: the repository's, whose paths are under
    data/curate_demo; for another folder, a copy inside it with its paths there (the repository's
    would curate data/curate_demo instead)."""
    if os.path.normpath(out_dir) == DEMO_DIR or not os.path.isfile(DEMO_CONFIG):
        return "configs/curate_demo.yaml"
    with open(DEMO_CONFIG, encoding="utf-8") as f:
        text = f.read().replace(DEMO_DIR, os.path.normpath(out_dir))
    path = os.path.join(out_dir, "curate.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path
