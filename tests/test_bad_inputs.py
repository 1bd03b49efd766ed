"""Bad input, as a new user or a cluster supplies it: each case must end with exit status 2 and one
line that names the field, file or record and the fix -- no traceback, nothing written.

Every case runs the real ``megazero`` command line in this process (``megazero.cli.main``), so a
table of 60-odd cases costs seconds. Files are made once per module: a small valid shard, a
tokenizer, a one-step checkpoint; each case then breaks one thing.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.indexed import IndexedDatasetWriter
from megazero.cli import main

VOCAB = 64


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
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
    only_idx = str(root / "onlyidx_text_document")
    shutil.copy(good + ".idx", only_idx + ".idx")

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
    pickled = root / "pickled" / "step_0000001"
    shutil.copytree(ckpt, pickled)
    record = json.loads((pickled / "COMPLETE").read_text())
    record["format"] = 1
    (pickled / "COMPLETE").write_text(json.dumps(record))

    locked = root / "locked"
    locked.mkdir()
    (locked / "LOCK").write_text(json.dumps({"host": os.uname().nodename, "pid": os.getpid(), "started": time.time()}))
    (root / "afile").write_text("x")
    (root / "emptydir").mkdir()
    (root / "dup.yaml").write_text("train:\n  seed: 3\nmodel:\n  num_layers: 2\ntrain:\n  train_steps: 5\n")
    (root / "bad_preset.yaml").write_text("datasets: [1.0, good_text_document]\n")
    return {"root": root, "good": good, "wide": wide, "recorded": recorded, "recorded_other": recorded_other,
            "rewritten": rewritten, "recorded_big": recorded_big, "truncated": truncated, "garbage": garbage,
            "only_idx": only_idx, "ckpt": str(ckpt), "run": str(run), "flipped": str(flipped),
            "edited": str(edited), "partial": str(nocomplete), "pickled": str(pickled), "locked": str(locked)}


def _model(prefix: str, run_dir: str) -> list[str]:
    return ["--model.num_layers", "2", "--model.hidden_size", "32", "--model.num_heads", "4",
            "--model.vocab_size", str(VOCAB), "--model.seq_length", "16", "--train.micro_batch_size", "2",
            "--train.global_batch_size", "4", "--train.train_steps", "2", "--train.device", "cpu",
            "--data.blend", f"[[1.0, {prefix}]]", "--data.split", "1", "--logging.run_dir", run_dir]


def _train(f, *extra, prefix=None):
    return ["train", *_model(prefix or f["good"], str(f["root"] / "runs" / "x")), *extra]


# (id, argv builder, substrings the error line must hold)
CASES = [
    # --- configs --------------------------------------------------------------------------------
    ("unknown-key", lambda f: _train(f, "--optimizer.lrr", "1"), ["optimizer.lrr: unknown key", "optimizer.lr"]),
    ("wrong-type", lambda f: _train(f, "--parallel.tp", "two"), ["parallel.tp: expected an integer"]),
    ("bool-type", lambda f: _train(f, "--train.compile", "maybe"), ["train.compile: expected true or false"]),
    ("no-value", lambda f: _train(f, "--train.seed"), ["--train.seed has no value"]),
    ("not-dotted", lambda f: _train(f, "--seed", "3"), ["--seed", "--section.field"]),
    ("missing-config", lambda f: ["train", str(f["root"] / "nope.yaml")], ["config file not found", "nope.yaml"]),
    ("bad-yaml", lambda f: ["train", str(f["root"] / "broken.jsonl")], ["broken.jsonl", "not valid YAML"]),
    ("yaml-not-mapping", lambda f: ["train", str(f["root"] / "array.jsonl")], ["array.jsonl", "top level"]),
    ("yaml-repeated-section", lambda f: ["train", str(f["root"] / "dup.yaml")],
     ["dup.yaml (line 5", "'train' appears twice (first on line 1)"]),
    ("lr-nan", lambda f: _train(f, "--optimizer.lr", "nan"), ["optimizer.lr: must be a finite number"]),
    ("lr-inf", lambda f: _train(f, "--optimizer.lr", ".inf"), ["optimizer.lr: must be a finite number"]),
    ("lr-negative", lambda f: _train(f, "--optimizer.lr", "-1"), ["optimizer.lr: must be positive"]),
    ("beta2", lambda f: _train(f, "--optimizer.beta2", "1.5"), ["optimizer.beta2: must be in [0, 1)"]),
    ("beta1", lambda f: _train(f, "--optimizer.beta1", "-0.1"), ["optimizer.beta1: must be in [0, 1)"]),
    ("eps-zero", lambda f: _train(f, "--optimizer.eps", "0"), ["optimizer.eps: must be positive"]),
    ("min-lr", lambda f: _train(f, "--optimizer.min_lr", "1"), ["optimizer.min_lr", "exceeds optimizer.lr"]),
    ("warmup-negative", lambda f: _train(f, "--schedule.warmup_steps", "-2"), ["schedule.warmup_steps: must be zero or more"]),
    ("decay-style", lambda f: _train(f, "--schedule.decay_style", "step"), ["schedule.decay_style", "cosine"]),
    ("no-stop", lambda f: _train(f, "--train.train_steps", "null"), ["train.train_steps", "train.train_tokens"]),
    ("tokens-no-decay", lambda f: _train(f, "--train.train_steps", "null", "--train.train_tokens", "1000"),
     ["schedule.decay_steps: must be set when train.train_steps is null"]),
    ("tokens-and-steps", lambda f: _train(f, "--train.train_tokens", "1000"),  # train_steps keeps its default
     ["train.train_tokens: 1000 is set and so is train.train_steps", "set train.train_steps null"]),
    ("steps-absurd", lambda f: _train(f, "--train.train_steps", "1000000000000000"),
     ["train.train_steps: 1000000000000000 steps of train.global_batch_size 4 are 4,000,000,000,000,000 samples",
      "GiB of host memory", "give a shorter run"]),
    ("tokens-absurd", lambda f: _train(f, "--train.train_steps", "null", "--train.train_tokens", "1000000000000000000",
                                       "--schedule.decay_steps", "10"),
     ["train.train_tokens: 1000000000000000000 tokens are", "give a shorter run"]),
    ("dropout", lambda f: _train(f, "--model.dropout", "1.0"), ["model.dropout: must be below 1"]),
    ("preset", lambda f: _train(f, "--model.preset", "gpt5"), ["model.preset: unknown preset 'gpt5'"]),
    ("norm", lambda f: _train(f, "--model.norm", "batchnorm"), ["model.norm: 'batchnorm' is not one of"]),
    ("heads", lambda f: _train(f, "--model.num_heads", "5"), ["model.hidden_size: 32 is not divisible by model.num_heads 5"]),
    ("layers-pp", lambda f: _train(f, "--parallel.pp", "3"), ["model.num_layers: 2", "parallel.pp"]),
    ("seq-parallel", lambda f: _train(f, "--parallel.sequence_parallel", "true"), ["parallel.sequence_parallel: needs parallel.tp > 1"]),
    ("virtual", lambda f: _train(f, "--parallel.virtual_stages", "2"), ["parallel.virtual_stages: interleaving needs parallel.pp > 1"]),
    ("batch", lambda f: _train(f, "--train.global_batch_size", "5"), ["train.global_batch_size: 5 is not divisible"]),
    ("rampup", lambda f: _train(f, "--schedule.rampup_start_batch", "8"), ["schedule.rampup_start_batch: 8 exceeds"]),
    ("split-nan", lambda f: _train(f, "--data.split", "nan,1,1"), ["data.split", "finite non-negative numbers"]),
    ("split-no-validation", lambda f: _train(f, "--train.eval_interval", "1"),  # the fixture's split is "1"
     ["data.split: '1' leaves no documents for validation, and train.eval_interval 1 evaluates"]),
    ("split-validation-rounds-away", lambda f: _train(f, "--data.split", "995,4,1", "--train.eval_interval", "1"),
     ["leaves", "good_text_document no documents for valid (64 documents in all)"]),
    ("rampup-no-samples", lambda f: _train(f, "--schedule.rampup_start_batch", "2"),
     ["schedule.rampup_samples: is 0, so schedule.rampup_start_batch 2 ramps nothing up"]),
    ("keep-last", lambda f: _train(f, "--checkpoint.keep_last", "0"), ["checkpoint.keep_last: must be positive"]),
    ("zero-stage", lambda f: _train(f, "--zero.stage", "4"), ["zero.stage: 4 is not one of"]),
    ("dtype", lambda f: _train(f, "--precision.dtype", "fp8"), ["precision.dtype: 'fp8' is not one of"]),
    ("device-cuda", lambda f: _train(f, "--train.device", "cuda"), ["train.device: is 'cuda' but no CUDA device"]),
    ("profile-steps", lambda f: _train(f, "--logging.profile_steps", "[3, 2]"),
     ["logging.profile_steps: expected [first, last] with 1 <= first <= last"]),
    ("profile-ranks", lambda f: _train(f, "--logging.profile_steps", "[1, 2]", "--logging.profile_ranks", "[4]"),
     ["logging.profile_ranks: [4] are not ranks of this world of 1"]),
    ("profile-past-end", lambda f: _train(f, "--logging.profile_steps", "[5, 6]"),
     ["logging.profile_steps: step 5 comes after the run's last step (train.train_steps 2)"]),
    ("steps-ahead", lambda f: _train(f, "--train.steps_ahead", "0"), ["train.steps_ahead: must be positive"]),
    ("steps-ahead-max", lambda f: _train(f, "--train.steps_ahead", "9"), ["train.steps_ahead: 9 is more than 8"]),
    ("vocab-auto-alone", lambda f: _train(f, "--model.vocab_size", "auto"), ["model.vocab_size: auto needs data.tokenizer"]),
    # --- data -----------------------------------------------------------------------------------
    ("no-data", lambda f: ["train", *_model(f["good"], str(f["root"] / "runs" / "x"))[:-6]],
     ["data.blend: no training data"]),
    ("missing-prefix", lambda f: _train(f, prefix=str(f["root"] / "absent")), ["data.blend", "absent", "megazero preprocess"]),
    ("only-idx", lambda f: _train(f, prefix=f["only_idx"]), ["data.blend", "onlyidx_text_document.bin"]),
    ("garbage-idx", lambda f: _train(f, prefix=f["garbage"]), ["data.blend", "garbage_text_document.idx"]),
    ("truncated-bin", lambda f: _train(f, prefix=f["truncated"]), ["data.blend", "truncated_text_document.bin"]),
    ("ids-past-vocab", lambda f: _train(f, prefix=f["wide"]), ["wide_text_document holds token id", "model.vocab_size is 64"]),
    ("ids-past-tokenizer", lambda f: _train(f, "--model.vocab_size", "256", "--data.tokenizer",
                                            str(f["root"] / "tokenizer.json"), prefix=f["wide"]),
     ["data.blend: ", "wide_text_document holds token id 255, beyond the 64 tokens of data.tokenizer"]),
    ("ids-past-record", lambda f: _train(f, "--model.vocab_size", "256", prefix=f["rewritten"]),
     ["rewritten_text_document holds token id 255 but records its tokenizer as tokenizer.json (64 tokens",
      "preprocess it again"]),
    ("model-smaller-than-record", lambda f: _train(f, prefix=f["recorded_big"]),
     ["model.vocab_size: 64 is smaller than the 258 tokens of the tokenizer", "recorded_big_text_document records",
      "set model.vocab_size 258"]),
    ("blend-weight", lambda f: _train(f, "--data.blend", f"[[-1.0, {f['good']}]]"), ["data.blend"]),
    ("blend-shape", lambda f: _train(f, "--data.blend", "[1, 2, 3]"), ["data.blend"]),
    ("blend-preset", lambda f: _train(f, "--data.blend", "null", "--data.blend_preset", "nope",
                                      "--data.blend_root", str(f["root"])), ["nope"]),
    ("blend-preset-entry", lambda f: _train(f, "--data.blend", "null", "--data.blend_preset",
                                            str(f["root"] / "bad_preset.yaml"), "--data.blend_root", str(f["root"])),
     ["bad_preset.yaml", "datasets[0] is 1.0", "[weight, name]"]),
    ("split", lambda f: _train(f, "--data.split", "a,b"), ["data"]),
    ("shard-of-another-tokenizer", lambda f: _train(f, "--data.tokenizer", str(f["root"] / "other_tokenizer.json"),
                                                    prefix=f["recorded"]),
     ["data.tokenizer: ", "recorded_text_document was tokenized with tokenizer.json (64 tokens", "other_tokenizer.json"]),
    ("blend-of-two-tokenizers", lambda f: _train(f, "--data.blend", f"[[1.0, {f['recorded']}], [1.0, {f['recorded_other']}]]"),
     ["data.blend: ", "recorded_other_text_document was tokenized with other_tokenizer.json", "must share a tokenizer"]),
    ("merge-of-two-tokenizers", lambda f: ["preprocess", "--merge", f["recorded"], f["recorded_other"], "--output-prefix",
                                           str(f["root"] / "out" / "merged")], ["must share a tokenizer"]),
    ("seq-longer-than-data", lambda f: _train(f, "--model.seq_length", "6000"),
     ["model.seq_length: a sample of 6000 needs 6000+1 tokens", "good_text_document's train split holds 5120 (64 "]),
    ("split-no-training", lambda f: _train(f, "--data.split", "0,0,1"), ["data.split: '0,0,1' leaves no documents"]),
    ("data-seed", lambda f: _train(f, "--data.seed", "-5"), ["data.seed: -5 is outside"]),
    # --- tokenizers -----------------------------------------------------------------------------
    ("tokenizer-missing", lambda f: _train(f, "--data.tokenizer", str(f["root"] / "nope.model")),
     ["data.tokenizer", "nope.model"]),
    ("tokenizer-text", lambda f: _train(f, "--data.tokenizer", str(f["root"] / "notes.txt")), ["data.tokenizer", "notes.txt"]),
    ("tokenizer-empty", lambda f: _train(f, "--data.tokenizer", str(f["root"] / "empty.model")), ["data.tokenizer", "empty.model"]),
    ("tokenizer-dir", lambda f: _train(f, "--data.tokenizer", str(f["root"] / "emptydir")), ["data.tokenizer", "emptydir"]),
    ("tokenizer-bigger", lambda f: _train(f, "--data.tokenizer", str(f["root"] / "big_tokenizer.json")),
     ["model.vocab_size: 64 is smaller than the 258 tokens"]),
    ("vocab-auto-bad-tokenizer", lambda f: _train(f, "--model.vocab_size", "auto", "--data.tokenizer",
                                                  str(f["root"] / "notes.txt")), ["data.tokenizer", "notes.txt"]),
    ("encode-not-tokenizer", lambda f: ["tokenizer", "encode", "--tokenizer", str(f["root"] / "notes.txt"), "x"],
     ["notes.txt"]),
    # --- directories ----------------------------------------------------------------------------
    ("run-dir-under-file", lambda f: _train(f, "--logging.run_dir", str(f["root"] / "afile" / "run")),
     ["logging.run_dir", "afile is a file"]),
    ("save-dir-under-file", lambda f: _train(f, "--checkpoint.save_dir", str(f["root"] / "afile" / "ck")),
     ["checkpoint.save_dir", "afile is a file"]),
    ("run-dir-locked", lambda f: _train(f, "--logging.run_dir", f["locked"]), ["run directory is in use by pid", "logging.run_dir"]),
    # --- checkpoints ----------------------------------------------------------------------------
    ("load-missing", lambda f: _train(f, "--checkpoint.load", str(f["root"] / "nockpt")), ["nockpt", "checkpoint.load"]),
    ("load-empty-dir", lambda f: _train(f, "--checkpoint.load", str(f["root"] / "locked")), ["holds no complete checkpoint"]),
    ("load-partial", lambda f: _train(f, "--checkpoint.load", f["partial"]), ["not a complete checkpoint"]),
    ("load-flipped", lambda f: _train(f, "--checkpoint.load", f["flipped"]), ["rank_00000.safetensors", "corrupted"]),
    ("load-edited-complete", lambda f: _train(f, "--checkpoint.load", f["edited"]), ["COMPLETE"]),
    # a run's own damaged checkpoint: checkpoint.load cannot reach past it, so the way back is named
    ("save-dir-flipped", lambda f: _train(f, "--checkpoint.save_dir", f["flipped"]),
     ["checkpoint.save_dir: ", "rank_00000.safetensors", "corrupted", "(to resume from the checkpoint before it "
      "instead, move", "step_0000001 out of"]),
    ("save-dir-edited-complete", lambda f: _train(f, "--checkpoint.save_dir", f["edited"]),
     ["checkpoint.save_dir: ", "COMPLETE", "(to resume from the checkpoint before it instead, move"]),
    ("save-dir-other-model", lambda f: _train(f, "--checkpoint.save_dir", str(Path(f["ckpt"]).parent),
                                              "--model.hidden_size", "64"),
     ["checkpoint.save_dir: ", "trained with a different model (model.hidden_size)",
      "start a new run in another checkpoint.save_dir"]),
    ("load-old-format", lambda f: _train(f, "--checkpoint.load", f["pickled"]), ["format"]),
    ("load-other-model", lambda f: _train(f, "--checkpoint.load", f["ckpt"], "--model.hidden_size", "64"),
     ["different model", "model.hidden_size"]),
    ("load-other-norm-eps", lambda f: _train(f, "--checkpoint.load", f["ckpt"], "--model.norm_eps", "1e-6"),
     ["different model", "model.norm_eps"]),
    ("resume-other-data-order", lambda f: _train(f, "--checkpoint.load", f["ckpt"], "--data.seed", "99"),
     ["(step 1) was trained on another data order (data.seed changed)", "checkpoint.allow_config_changes true"]),
    ("resume-more-epochs", lambda f: _train(f, "--checkpoint.load", f["ckpt"], "--train.global_batch_size", "200"),
     ["400 training samples in all instead of 4", "another number of epochs"]),
    ("resume-lr-jump", lambda f: _train(f, "--checkpoint.load", f["ckpt"], "--train.train_steps", "10"),
     ["learning rate of step 2 from", "train.train_steps changed", "set schedule.decay_steps 1"]),
    ("save-dir-damaged", lambda f: _train(f, "--checkpoint.save_dir", str(Path(f["partial"]).parent)),
     ["checkpoint.save_dir", "step_0000001: a checkpoint directory without its COMPLETE record"]),
    # --- generate -------------------------------------------------------------------------------
    ("generate-missing", lambda f: ["generate", str(f["root"] / "nockpt"), "--tokenizer", str(f["root"] / "tokenizer.json")],
     ["nockpt"]),
    ("generate-negative", lambda f: ["generate", f["ckpt"], "--tokenizer", str(f["root"] / "tokenizer.json"), "--tokens", "-5"],
     ["--tokens"]),
    ("generate-not-tokenizer", lambda f: ["generate", f["ckpt"], "--tokenizer", str(f["root"] / "notes.txt")], ["notes.txt"]),
    ("generate-bigger-tokenizer", lambda f: ["generate", f["ckpt"], "--tokenizer", str(f["root"] / "big_tokenizer.json")],
     ["big_tokenizer.json", "has 258 tokens", "model has 64"]),
    ("generate-prompt-before-load", lambda f: ["generate", f["flipped"], "--tokenizer", str(f["root"] / "tokenizer.json"),
                                               "--prompt", ""], ["encodes to no tokens"]),  # not the damaged file
    ("generate-prompt-not-utf8", lambda f: ["generate", f["ckpt"], "--tokenizer", str(f["root"] / "tokenizer.json"),
                                            "--prompt", "w1 \udcff"],  # argv's undecodable byte 0xff
     ["--prompt: not valid UTF-8 text (byte 0xff at position 3)"]),
    ("tokenizer-encode-not-utf8", lambda f: ["tokenizer", "encode", "--tokenizer", str(f["root"] / "tokenizer.json"),
                                             "w1 \udcff"], ["TEXT: not valid UTF-8 text (byte 0xff at position 3)"]),
    *[(f"generate-temperature-{text}", (lambda text: lambda f: [
        "generate", f["ckpt"], "--tokenizer", str(f["root"] / "tokenizer.json"), "--temperature", text])(text),
       ["--temperature"]) for text in ("-1", "nan", "inf")],
    # --- preprocessing --------------------------------------------------------------------------
    *[(f"preprocess-{name}", (lambda name: lambda f: [
        "preprocess", "--input", str(f["root"] / f"{name}.jsonl"), "--tokenizer", str(f["root"] / "tokenizer.json"),
        "--output-prefix", str(f["root"] / "out" / name), "--no-progress"])(name), [f"{name}.jsonl:{line}", *words])
      for name, line, words in [("null", 2, ["text", "null"]), ("nested", 1, ["text", "object"]),
                                ("number", 1, ["text"]), ("nokey", 2, ["text"]), ("broken", 2, ["malformed JSON"]),
                                ("latin1", 2, ["not UTF-8"]), ("array", 1, ["text"])]],
    ("preprocess-cut-gz", lambda f: ["preprocess", "--input", str(f["root"] / "cut.jsonl.gz"), "--tokenizer",
                                     str(f["root"] / "tokenizer.json"), "--output-prefix", str(f["root"] / "out" / "cut"),
                                     "--no-progress"], ["cut.jsonl.gz"]),
    ("preprocess-missing-input", lambda f: ["preprocess", "--input", str(f["root"] / "none.jsonl"), "--tokenizer",
                                            str(f["root"] / "tokenizer.json"), "--output-prefix", str(f["root"] / "out" / "n")],
     ["none.jsonl"]),
    ("preprocess-no-tokenizer", lambda f: ["preprocess", "--input", str(f["root"] / "good.jsonl"),
                                           "--output-prefix", str(f["root"] / "out" / "g")], ["--tokenizer"]),
    ("preprocess-not-tokenizer", lambda f: ["preprocess", "--input", str(f["root"] / "good.jsonl"), "--tokenizer",
                                            str(f["root"] / "notes.txt"), "--output-prefix", str(f["root"] / "out" / "g")],
     ["notes.txt"]),
    ("preprocess-output-unwritable", lambda f: ["preprocess", "--input", str(f["root"] / "good.jsonl"), "--tokenizer",
                                                str(f["root"] / "tokenizer.json"), "--output-prefix", "/proc/megazero/x"],
     ["--output-prefix /proc/megazero/x: cannot create /proc/megazero"]),
    ("tokenizer-train-empty", lambda f: ["tokenizer", "train", "--input", str(f["root"] / "empty.model"),
                                         "--model-prefix", str(f["root"] / "out" / "tk")], ["no text to train on"]),
    ("tokenizer-train-binary", lambda f: ["tokenizer", "train", "--input", str(f["root"] / "binary.txt"),
                                          "--model-prefix", str(f["root"] / "out" / "tk")],
     ["binary.txt:2: a NUL byte at 9: binary data, not text"]),
    ("tokenizer-train-exists", lambda f: ["tokenizer", "train", "--input", str(f["root"] / "good.jsonl"),
                                          "--model-prefix", str(f["root"] / "empty")],
     ["empty.model: exists (data and checkpoints record the tokenizer", "choose another --model-prefix"]),
    ("tokenizer-train-folder", lambda f: ["tokenizer", "train", "--input", str(f["root"] / "good.jsonl"),
                                          "--model-prefix", str(f["root"]) + "/"], ["names a folder"]),
    *[(f"tokenizer-train-{flag[2:]}-{value}", (lambda flag, value: lambda f: [
        "tokenizer", "train", "--input", str(f["root"] / "good.jsonl"), "--model-prefix", str(f["root"] / "out" / "tk"),
        flag, value])(flag, value), words) for flag, value, words in [
        ("--vocab-size", "10000000000", ["--vocab-size: must be at most 2147483647"]),
        ("--max-sentences", "-5", ["--max-sentences: must be between 1 and"]),
        ("--vocab-size", "5000", ["vocabulary size 5000 is more than this text can fill (at most", "more text"])]],
    *[(f"demo-corpus-max-mb-{text}", (lambda text: lambda f: [
        "demo-corpus", str(f["root"] / "out" / "demo"), "--max-mb", text])(text),
       [f"--max-mb: must be a positive number of MB, got {text}"]) for text in ("inf", "nan", "0.0")],
    ("demo-corpus-exists", lambda f: ["demo-corpus", str(f["root"])], ["stdlib.jsonl: exists", "remove it first"]),
    ("preprocess-workers", lambda f: ["preprocess", "--input", str(f["root"] / "good.jsonl"), "--tokenizer",
                                      str(f["root"] / "tokenizer.json"), "--output-prefix", str(f["root"] / "out" / "g"),
                                      "--workers", "0"], ["--workers"]),
    ("preprocess-prefix-folder", lambda f: ["preprocess", "--input", str(f["root"] / "good.jsonl"), "--tokenizer",
                                            str(f["root"] / "tokenizer.json"), "--output-prefix", str(f["root"] / "out") + "/"],
     ["--output-prefix", "names a folder; give a path and file-name prefix inside it"]),
    ("preprocess-hf-split-of-a-file", lambda f: ["preprocess", "--input", str(f["root"] / "good.jsonl"), "--tokenizer",
                                                 str(f["root"] / "tokenizer.json"), "--output-prefix",
                                                 str(f["root"] / "out" / "g"), "--hf-split", "validation"],
     ["--hf-split validation: picks the split of a Hugging Face dataset input, and none is given"]),
]


@pytest.mark.parametrize("argv, expected", [pytest.param(build, words, id=name) for name, build, words in CASES])
def test_bad_input_is_one_line_naming_the_problem(files, capsys, argv, expected):
    argv = argv(files)
    before = sorted(p.name for p in (files["root"] / "runs").glob("*")) if (files["root"] / "runs").exists() else []
    try:
        code = main(argv)
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
    except SystemExit as exit_:  # argparse's own errors (a bad flag value): its usage, then one line
        code = exit_.code
        err = capsys.readouterr().err
        lines = err.strip().splitlines()[-1:]
    assert code == 2, err
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert all(word in lines[0] for word in expected), (expected, lines[0])
    after = sorted(p.name for p in (files["root"] / "runs").glob("*")) if (files["root"] / "runs").exists() else []
    if after != before:  # a checksum found bad while loading: the run directory exists, but holds no record
        assert not list((files["root"] / "runs").glob("*/config.yaml")), "a refused launch must not write config.yaml"
        assert not list((files["root"] / "runs").glob("*/LOCK")), "a refused launch must release its lock"


def test_the_table_is_at_least_sixty_cases():
    assert len(CASES) >= 60


def test_a_rendezvous_port_in_use_is_one_line(files, capsys, monkeypatch):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    try:
        code = main(_train(files))
    finally:
        taken.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"MASTER_PORT 127.0.0.1:{port} is already in use" in err[0] and "set MASTER_PORT" in err[0], err
    assert not list((files["root"] / "runs").glob("*/LOCK")), "the lock is released"


def test_an_unfinished_first_save_is_said_and_the_record_kept(files, capsys):
    """A run whose only checkpoint died mid-save starts over, saying so; its metrics are kept, marked."""
    run = files["root"] / "unfinished"
    (run / "checkpoints" / "step_0000002.tmp").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "lo')
    assert main(["train", *_model(files["good"], str(run)), "--train.train_steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "holds no complete checkpoint, only the unfinished save step_0000002.tmp; starting from step 0" in out
    text = (run / "metrics.jsonl").read_text()
    assert text.startswith('{"step": 1, "loss": 9.0}\n{"step": 2, "lo\n{"event": "resume", "step": 0'), text


def test_which_checkpoint_a_run_starts_from(tmp_path):
    """The run's own checkpoints in save_dir come before checkpoint.load (a requeued job relaunched with
    the same command used to start over from checkpoint.load every time), also one inside save_dir;
    a load that no longer exists does not matter then; with nothing in save_dir the load starts the run."""
    from megazero.checkpoint import start_checkpoint

    own, other, empty = tmp_path / "own", tmp_path / "other", tmp_path / "empty"
    for step_dir in (own / "step_0000001", own / "step_0000002", other / "step_0000005"):
        step_dir.mkdir(parents=True)
        (step_dir / "COMPLETE").write_text("{}")
    empty.mkdir()
    assert start_checkpoint(None, own) == (own / "step_0000002", "checkpoint.save_dir")
    assert start_checkpoint(str(other), own) == (own / "step_0000002", "checkpoint.save_dir")
    assert start_checkpoint(str(own / "step_0000001"), own) == (own / "step_0000002", "checkpoint.save_dir")
    assert start_checkpoint(str(tmp_path / "deleted" / "step_0000009"), own) == (own / "step_0000002",
                                                                                "checkpoint.save_dir")
    assert start_checkpoint(str(other), empty) == (other / "step_0000005", "checkpoint.load")
    assert start_checkpoint(None, empty) == (None, "checkpoint.save_dir")


def test_a_relaunch_continues_from_its_own_checkpoint(files, capsys):
    """The same command twice: the first launch starts from checkpoint.load and saves in its own
    save_dir, the second continues from there, saying why it does not load checkpoint.load again."""
    run = files["root"] / "relaunched"
    argv = ["train", *_model(files["good"], str(run)), "--checkpoint.load", files["ckpt"]]
    assert main(argv) == 0
    assert f"resumed from {files['ckpt']} at step 1" in capsys.readouterr().out
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "resuming this run's own checkpoint" in out and "step_0000002" in out, out
    assert "already finished at step 2" in out, out


def test_a_warm_up_longer_than_the_run_is_said_at_its_start(files, capsys):
    """Legal (a smoke run of a full config), but the learning rate never reaches its peak: said once."""
    run = files["root"] / "short"
    assert main(["train", *_model(files["good"], str(run)), "--schedule.warmup_steps", "8"]) == 0
    out = capsys.readouterr().out
    assert "note: schedule.warmup_steps 8 is more than train.train_steps 2: the learning rate ends at 0.25" in out, out


def test_an_empty_validation_split_is_refused_only_where_the_evaluation_draws(files, capsys, tmp_path):
    """A dataset the evaluation's blend never samples may have no validation documents; one it samples
    may not: the check follows the blend, as the run's index build does. (Megatron's greedy rule gives
    the second dataset the blend's second sample whatever its weight, so the tiny one comes third.)"""
    tiny = str(tmp_path / "tiny_text_document")
    with IndexedDatasetWriter(tiny, np.uint16) as w:
        for _ in range(5):  # 969,30,1 of 5 documents leaves validation none
            w.add_document(np.arange(1, 40, dtype=np.uint16))
    check = ["--data.split", "969,30,1", "--train.eval_interval", "1", "--check"]
    good = files["good"]
    filler = files["recorded"]  # another dataset of 64 documents, to take the blend's second sample
    assert main(_train(files, "--data.blend", f"[[1.0, {good}], [1.0e-6, {filler}], [1.0e-6, {tiny}]]", *check)) == 0
    capsys.readouterr()
    assert main(_train(files, "--data.blend", f"[[1.0, {good}], [1.0e-6, {tiny}]]", *check)) == 2
    assert "tiny_text_document no documents for valid (5 documents in all)" in capsys.readouterr().err


def test_tokens_and_steps_together_are_refused_for_a_run_only():
    """The refusal is preflight's, not the config's: `convert` re-validates the config a checkpoint
    records, and a checkpoint of a run that set both (before the refusal) must still reshard."""
    import dataclasses

    from megazero.config import Config, resolve_config
    from megazero.preflight import _stop_problems

    cfg = Config()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, train_tokens=1000))
    assert resolve_config(cfg, 1).train.train_tokens == 1000
    assert _stop_problems(cfg) and not _stop_problems(dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, train_steps=None)))


def test_a_setting_that_changes_nothing_is_said_at_the_start(files, capsys):
    """`parallel.recompute_every` without full recompute was accepted and ignored without a word."""
    argv = ["train", *_model(files["good"], str(files["root"] / "runs" / "noted")), "--check"]
    assert main([*argv, "--parallel.recompute_every", "3"]) == 0
    assert "note: parallel.recompute_every 3 applies to parallel.recompute full only; with 'none'" in \
        capsys.readouterr().out


def test_a_wall_clock_stop_saves_even_without_save_on_exit(files, capsys):
    """`train.max_wall_seconds` promises a save, as a preemption does; with `save_on_exit` false the
    stop said "saving" and wrote nothing, and the steps trained were lost. A run that can save only on
    those stops is told so at its start."""
    run = files["root"] / "wall"
    argv = ["train", *_model(files["good"], str(run)), "--checkpoint.save_on_exit", "false"]
    assert main([*argv, "--train.max_wall_seconds", "1e-9"]) == 0
    out = capsys.readouterr().out
    assert "note: checkpoint.save_on_exit is false and checkpoint.save_interval 0" in out, out
    assert "recompute_every" not in out
    assert "for the wall-clock limit; saving" in out and (run / "checkpoints" / "step_0000001").is_dir(), out


def test_a_shard_records_its_tokenizer_through_preprocess_and_merge(files, capsys):
    """What the tokenizer checks compare with: preprocessing records the tokenizer's digest beside the
    shard, a merge carries it over, and a run with that tokenizer passes."""
    from data_pipeline.shard_origin import read_origin, tokenizer_identity
    from data_pipeline.tokenizer import load_tokenizer

    tok, out = str(files["root"] / "tokenizer.json"), files["root"] / "recorded_out"
    made = [str(out / name) for name in ("a", "b")]
    for prefix in made:
        assert main(["preprocess", "--input", str(files["root"] / "whole.jsonl.gz"), "--tokenizer", tok,
                     "--output-prefix", prefix, "--no-progress"]) == 0
    merged = str(out / "merged_text_document")
    assert main(["preprocess", "--merge", *(f"{p}_text_document" for p in made), "--output-prefix", merged]) == 0
    assert read_origin(merged) == read_origin(f"{made[0]}_text_document") == tokenizer_identity(load_tokenizer(tok))
    capsys.readouterr()
    assert main(_train(files, "--data.tokenizer", tok, "--check", prefix=merged)) == 0, capsys.readouterr().err
    folder = files["root"] / "tokenizer_folder"  # a folder holding tokenizer.json is a tokenizer too
    folder.mkdir()
    shutil.copy(tok, folder / "tokenizer.json")
    assert main(["preprocess", "--input", str(files["root"] / "good.jsonl"), "--tokenizer", str(folder),
                 "--output-prefix", str(out / "f"), "--no-progress"]) == 0
    assert read_origin(str(out / "f_text_document")) == read_origin(merged)
    assert main(_train(files, "--data.tokenizer", str(folder), "--check", prefix=merged)) == 0


def test_a_checkpoint_knows_its_tokenizer_and_refuses_another(files, capsys, tmp_path):
    """A tokenizer of another vocabulary no larger than the model's decoded garbage in `generate` and
    exported a Hugging Face folder encoding text to ids the model never saw, without a word. A
    checkpoint now records the tokenizer its data came from: `data.tokenizer`, else what the shards
    record; a reshard carries the record over."""
    from megazero.checkpoint import read_manifest
    from data_pipeline.shard_origin import tokenizer_identity
    from data_pipeline.tokenizer import load_tokenizer

    tok, other = str(files["root"] / "tokenizer.json"), str(files["root"] / "other_tokenizer.json")
    mine = tokenizer_identity(load_tokenizer(tok))
    runs = {"named": ("--data.tokenizer", tok), "recorded": ()}  # data.tokenizer, or the shards' record only
    for name, extra in runs.items():
        run = tmp_path / name
        prefix = files["recorded"] if name == "recorded" else None
        assert main(["train", *_model(prefix or files["good"], str(run)), "--train.train_steps", "1", *extra]) == 0
        ckpt = run / "checkpoints" / "step_0000001"
        assert read_manifest(ckpt)["meta"]["tokenizer"] == mine
    capsys.readouterr()
    assert main(["generate", str(ckpt), "--tokenizer", other, "--tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tokenizer" in err[0] and "other_tokenizer.json: is not the tokenizer this " \
        f"checkpoint was trained with (tokenizer.json ({VOCAB} tokens, sha256 {mine['tokenizer_sha256'][:12]})" in err[0], err
    assert main(["generate", str(ckpt), "--tokenizer", tok, "--tokens", "2", "--prompt", "w1 w2"]) == 0
    assert main(["convert", str(ckpt), str(tmp_path / "hf"), "--to", "hf", "--tokenizer", other]) == 2
    assert "is not the tokenizer this checkpoint was trained with" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
    assert main(["convert", str(ckpt), str(tmp_path / "exported"), "--to", "hf", "--tokenizer", tok]) == 0
    assert (tmp_path / "exported" / "tokenizer.json").read_bytes() != Path(tok).read_bytes()
    capsys.readouterr()  # the exported folder rewrites the file, and holds the same pieces: accepted
    assert main(["generate", str(ckpt), "--tokenizer", str(tmp_path / "exported"), "--tokens", "2"]) == 0, \
        capsys.readouterr().err
    assert main(["convert", str(ckpt), str(tmp_path / "resharded"), "--to", "megazero", "--tp", "1"]) == 0
    resharded = next((tmp_path / "resharded").glob("step_*"))
    assert read_manifest(resharded)["meta"]["tokenizer"] == mine
    named = tmp_path / "named" / "checkpoints" / "step_0000001"  # trained on the unrecorded shards
    resume = ["train", *_model(files["good"], str(tmp_path / "on")), "--checkpoint.load", str(named)]
    capsys.readouterr()  # training on with data of another tokenizer is refused...
    assert main([*resume, "--data.tokenizer", other]) == 2
    assert "(step 1) was trained on ids of tokenizer.json" in capsys.readouterr().err
    assert main(resume) == 0  # ...and data that names none keeps the checkpoint's record
    assert read_manifest(tmp_path / "on" / "checkpoints" / "step_0000002")["meta"]["tokenizer"] == mine


def test_a_logger_without_its_package_is_refused_before_the_run(files, capsys):
    """``--check`` said "config ok" and the run stopped once its model was built."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here")
    assert main(_train(files, "--logging.tensorboard", "true", "--check")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "logging.tensorboard: is on but the tensorboard package is not installed" in err[0], err


def test_a_resume_with_the_same_data_spelled_otherwise_passes(files, capsys):
    """The data order is compared by the files a blend names, not by how their paths are written."""
    prefix = files["good"].replace("/good_text_document", "/./good_text_document")
    assert prefix != files["good"]
    code = main(_train(files, "--checkpoint.load", files["ckpt"], "--check", prefix=prefix))
    assert code == 0, capsys.readouterr().err


def test_the_epoch_check_skips_what_the_run_does_not_sample(files, tmp_path):
    """A blend entry of weight 0, or a shard that cannot be opened (its own check names it), neither
    hangs nor raises in the resume check (an empty dataset once looped forever looking for its epochs)."""
    from megazero.config import load_config
    from megazero.preflight import _epochs_change

    cfg = load_config(None, _model(files["good"], str(tmp_path))[:-2])
    assert _epochs_change(files["good"], 0.0, cfg, 4, 4000) is False
    assert _epochs_change(str(tmp_path / "absent"), 1.0, cfg, 4, 4000) is False
    assert _epochs_change(files["good"], 1.0, cfg, 4, 300) is False  # 319 samples an epoch
    assert _epochs_change(files["good"], 1.0, cfg, 4, 320) is True
