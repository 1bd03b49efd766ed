"""A tiny fastText quality model for curation tests, trained through `megazero curate train-quality`."""

from __future__ import annotations

import json
import random
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
