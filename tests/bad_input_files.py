"""The files the bad-input tests break one at a time: a small valid shard and broken ones, three
tokenizers, jsonl inputs each wrong in one way, a one-step checkpoint and damaged copies of it, a
locked run folder. Made once per test module (``files``), in this process, through the real
``megazero`` command line."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from data_pipeline.indexed import IndexedDatasetWriter
from megazero.cli import main

VOCAB = 64


def _model(prefix: str, run_dir: str) -> list[str]:
    return ["--model.num_layers", "2", "--model.hidden_size", "32", "--model.num_heads", "4",
            "--model.vocab_size", str(VOCAB), "--model.seq_length", "16", "--train.micro_batch_size", "2",
            "--train.global_batch_size", "4", "--train.train_steps", "2", "--train.device", "cpu",
            "--data.blend", f"[[1.0, {prefix}]]", "--data.split", "1", "--logging.run_dir", run_dir]


def _train(f, *extra, prefix=None):
    return ["train", *_model(prefix or f["good"], str(f["root"] / "runs" / "x")), *extra]


def make_files(root: Path) -> dict:
    """Every file the cases need, under ``root``; returns the paths they name."""
    rng = np.random.default_rng(0)

    def shard(name, high):
        prefix = str(root / name)
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            for _ in range(64):
                w.add_document(rng.integers(1, high, 80).astype(np.uint16))
        return prefix

    good, wide = shard("good_text_document", VOCAB), shard("wide_text_document", 4 * VOCAB)
    truncated = shard("truncated_text_document", VOCAB)
    with open(truncated + ".bin", "r+b") as f:
        f.truncate(100)
    garbage = str(root / "garbage_text_document")
    Path(garbage + ".idx").write_bytes(b"not an index at all" * 10)
    Path(garbage + ".bin").write_bytes(b"\0" * 64)
    nodocs = str(root / "nodocs_text_document")  # written by another tool: megazero never writes one
    with IndexedDatasetWriter(nodocs, np.uint16):
        pass
    only_idx = str(root / "onlyidx_text_document")
    shutil.copy(good + ".idx", only_idx + ".idx")
    copied = str(root / "copied_text_document")  # a byte copy: other files, the same tokens
    for ext in (".bin", ".idx"):
        shutil.copy(good + ext, copied + ext)

    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(VOCAB - 2)} | {"<unk>": VOCAB - 2, "</s>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(root / "tokenizer.json"))
    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(4 * VOCAB)} | {"<unk>": 4 * VOCAB,
                                     "</s>": 4 * VOCAB + 1}, unk_token="<unk>"))
    big.save(str(root / "big_tokenizer.json"))
    other = Tokenizer(models.WordLevel({f"v{i}": i for i in range(VOCAB - 2)} | {"<unk>": VOCAB - 2, "</s>": VOCAB - 1},
                                       unk_token="<unk>"))
    other.save(str(root / "other_tokenizer.json"))
    from data_pipeline.shard_origin import tokenizer_identity, write_origin
    from data_pipeline.tokenizer import load_tokenizer

    recorded, recorded_other = shard("recorded_text_document", VOCAB), shard("recorded_other_text_document", VOCAB)
    write_origin(recorded, tokenizer_identity(load_tokenizer(str(root / "tokenizer.json"))))
    write_origin(recorded_other, tokenizer_identity(load_tokenizer(str(root / "other_tokenizer.json"))))
    rewritten, recorded_big = shard("rewritten_text_document", 4 * VOCAB), shard("recorded_big_text_document", VOCAB)
    write_origin(rewritten, tokenizer_identity(load_tokenizer(str(root / "tokenizer.json"))))  # ids past its record
    write_origin(recorded_big, tokenizer_identity(load_tokenizer(str(root / "big_tokenizer.json"))))
    (root / "notes.txt").write_text("this is not a tokenizer\n")
    (root / "empty.model").write_bytes(b"")
    (root / "stdlib.jsonl").write_text("")  # as if a demo corpus had been built here
    (root / "binary.txt").write_bytes(b"w1 w2\n" + bytes(range(1, 10)) + b"\0w3\n")  # ASCII, yet not text

    lines = {"good.jsonl": '{"text": "w1 w2 w3"}\n{"text": "w4 w5"}\n',
             "null.jsonl": '{"text": "w1"}\n{"text": null}\n',
             "nested.jsonl": '{"text": {"nested": 1}}\n',
             "number.jsonl": '{"text": 42}\n',
             "nokey.jsonl": '{"text": "w1"}\n{"body": "w2"}\n',
             "broken.jsonl": '{"text": "w1"}\n{"text": "w2"\n',
             "array.jsonl": '[1, 2, 3]\n'}
    for name, text in lines.items():
        (root / name).write_text(text)
    (root / "plain.jsonl.gz").write_text(lines["good.jsonl"])  # named compressed, but plain text
    (root / "stub.jsonl.gz").write_bytes(b"\x1f\x8b")  # cut inside gzip's header
    (root / "packed.jsonl").write_bytes(gzip.compress(lines["good.jsonl"].encode()))  # compressed, named plain
    (root / "latin1.jsonl").write_bytes(b'{"text": "w1"}\n{"text": "caf\xe9"}\n')
    with gzip.open(root / "whole.jsonl.gz", "wb") as f:
        f.write(('{"text": "w1 w2"}\n' * 2000).encode())
    data = (root / "whole.jsonl.gz").read_bytes()
    (root / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])

    run = root / "trained"
    code = main(["train", *_model(good, str(run)), "--train.train_steps", "1"])
    assert code == 0
    ckpt = run / "checkpoints" / "step_0000001"
    flipped = root / "flipped" / "checkpoints"
    shutil.copytree(run / "checkpoints", flipped)
    target = next((flipped / "step_0000001").glob("rank_*.safetensors"))
    raw = bytearray(target.read_bytes())
    raw[-1] ^= 0xFF
    target.write_bytes(bytes(raw))
    edited = root / "edited" / "checkpoints"
    shutil.copytree(run / "checkpoints", edited)
    complete = edited / "step_0000001" / "COMPLETE"
    record = json.loads(complete.read_text())
    record["meta"]["consumed"] += 1
    complete.write_text(json.dumps(record))
    nocomplete = root / "partial" / "step_0000001"
    shutil.copytree(ckpt, nocomplete)
    (nocomplete / "COMPLETE").unlink()
    cut = root / "cut" / "step_0000001"  # a copy that stopped part-way through a file
    shutil.copytree(ckpt, cut)
    target = next(cut.glob("rank_*.safetensors"))
    target.write_bytes(target.read_bytes()[:100])
    pickled = root / "pickled" / "step_0000001"
    shutil.copytree(ckpt, pickled)
    record = json.loads((pickled / "COMPLETE").read_text())
    record["format"] = 1
    (pickled / "COMPLETE").write_text(json.dumps(record))

    locked = root / "locked"
    locked.mkdir()
    (locked / "LOCK").write_text(json.dumps({"host": os.uname().nodename, "pid": os.getpid(), "started": time.time()}))
    live = root / "live"  # a run still training: its checkpoint, and the lock of its live job
    shutil.copytree(run, live)
    shutil.copy(locked / "LOCK", live / "LOCK")
    (root / "afile").write_text("x")
    (root / "emptydir").mkdir()
    (root / "dup.yaml").write_text("train:\n  seed: 3\nmodel:\n  num_layers: 2\ntrain:\n  train_steps: 5\n")
    (root / "bad_preset.yaml").write_text("datasets: [1.0, good_text_document]\n")
    return {"root": root, "good": good, "wide": wide, "recorded": recorded, "recorded_other": recorded_other,
            "rewritten": rewritten, "recorded_big": recorded_big, "truncated": truncated, "garbage": garbage,
            "only_idx": only_idx, "copied": copied, "nodocs": nodocs, "ckpt": str(ckpt), "run": str(run), "flipped": str(flipped),
            "edited": str(edited), "partial": str(nocomplete), "cut": str(cut), "pickled": str(pickled),
            "locked": str(locked), "live": str(live)}
