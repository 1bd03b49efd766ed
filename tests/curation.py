"""Curation test helpers: a tiny fastText quality model, and the demo chain of commands the pages show."""

from __future__ import annotations

import json
import random
import re
import shlex
from pathlib import Path

from data_pipeline.curate.quality import MIN_BUCKETS, train_quality


def train_quality_model(directory: Path, good_words: list[str], bad_words: list[str], docs: int, epoch: int,
                        seed: int = 0) -> str:
    """Train on ``docs`` documents of 30 words drawn from each vocabulary; returns the model's path. The
    fewest word-bigram rows fastText is given: at its default each model is 488 MiB, written, read by
    every quality task and copied by the truncation tests, which was most of the curation tests' time
    on a shared disk (the command's own path, at the default, is tested in test_curate_quality.py)."""
    rng = random.Random(seed)
    for name, vocab in (("hq", good_words), ("lq", bad_words)):
        with open(directory / f"{name}.jsonl", "w") as f:
            for _ in range(docs):
                f.write(json.dumps({"text": " ".join(rng.choice(vocab) for _ in range(30))}) + "\n")
    model = str(directory / "quality.bin")
    train_quality([str(directory / "hq.jsonl")], [str(directory / "lq.jsonl")], model, epoch=epoch, bucket=MIN_BUCKETS)
    return model


def shown_demo_chain(page: Path) -> list[list[str]]:
    """The ``megazero`` commands of ``page``'s shell block that starts with ``megazero curate demo``, each as
    the argument list after ``megazero`` (continued lines joined, comments dropped): what a reader types."""
    blocks = re.findall(r"^```bash\n(megazero curate demo.*?)^```", page.read_text(encoding="utf-8"), re.M | re.S)
    assert len(blocks) == 1, f"{page}: expected one shell block starting with `megazero curate demo`"
    lines = blocks[0].replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True)[1:] for line in lines if line.startswith("megazero ")]
