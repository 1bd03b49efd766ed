"""Curation test helpers: a tiny fastText quality model, trained through `megazero curate train-quality`, and
the demo chain of commands the pages show."""

from __future__ import annotations

import json
import random
import re
import shlex
from pathlib import Path

from megazero.cli import main


def train_quality_model(directory: Path, good_words: list[str], bad_words: list[str], docs: int, epoch: int,
                        seed: int = 0) -> str:
    """Train on ``docs`` documents of 30 words drawn from each vocabulary; returns the model's path."""
    rng = random.Random(seed)
    for name, vocab in (("hq", good_words), ("lq", bad_words)):
        with open(directory / f"{name}.jsonl", "w") as f:
            for _ in range(docs):
                f.write(json.dumps({"text": " ".join(rng.choice(vocab) for _ in range(30))}) + "\n")
    model = directory / "quality.bin"
    assert main(["curate", "train-quality", "--hq", str(directory / "hq.jsonl"), "--lq", str(directory / "lq.jsonl"),
                 "--output", str(model), "--epoch", str(epoch)]) == 0
    return str(model)


def shown_demo_chain(page: Path) -> list[list[str]]:
    """The ``megazero`` commands of ``page``'s shell block that starts with ``megazero curate demo``, each as
    the argument list after ``megazero`` (continued lines joined, comments dropped): what a reader types."""
    blocks = re.findall(r"^```bash\n(megazero curate demo.*?)^```", page.read_text(encoding="utf-8"), re.M | re.S)
    assert len(blocks) == 1, f"{page}: expected one shell block starting with `megazero curate demo`"
    lines = blocks[0].replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True)[1:] for line in lines if line.startswith("megazero ")]
