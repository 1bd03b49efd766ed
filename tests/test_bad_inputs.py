"""Bad input, as a new user or a cluster supplies it: each case must end with exit status 2 and one
line that names the field, file or record and the fix -- no traceback, nothing written.

Every case runs the real ``megazero`` command line in this process (``megazero.cli.main``), so a
table of 160-odd cases costs seconds. Files are made once per module (``tests/bad_input_files.py``):
a small valid shard, a tokenizer, a one-step checkpoint; each case then breaks one thing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megazero.cli import main
from tests.bad_input_files import _model, _train, make_files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_files(tmp_path_factory.mktemp("inputs"))


# (id, argv builder, substrings the error line must hold)
CASES = [
    # --- configs --------------------------------------------------------------------------------
    ("unknown-key", lambda f: _train(f, "--optimizer.lrr", "1"), ["optimizer.lrr: unknown key", "optimizer.lr"]),
    ("wrong-type", lambda f: _train(f, "--parallel.tp", "two"), ["parallel.tp: expected an integer"]),
    ("bool-type", lambda f: _train(f, "--train.compile", "maybe"), ["train.compile: expected true, false or null"]),
    ("no-value", lambda f: _train(f, "--train.seed"), ["--train.seed has no value"]),
    ("not-dotted", lambda f: _train(f, "--seed", "3"), ["--seed", "--section.field"]),
    ("missing-config", lambda f: ["train", str(f["root"] / "nope.yaml")], ["config file not found", "nope.yaml"]),
    ("config-is-a-folder", lambda f: ["train", str(f["root"] / "emptydir")],
     ["emptydir: is a folder, not a config file; give a YAML file"]),
    ("config-is-a-run-dir", lambda f: ["train", f["run"]],
     ["trained: is a folder, not a config file; give a YAML file, such as", "trained/config.yaml"]),
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
    ("vocab-rows", lambda f: _train(f, "--model.vocab_size", "8388600"),
     ["model.vocab_size: 8388600 (padded to 8388608 for parallel.tp 1) must be below 8388608"]),
    ("position-rows", lambda f: _train(f, "--model.seq_length", "8388608"),
     ["model.seq_length: 8388608 learned positions", "model.position_embedding rope"]),
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
    ("blend-weight-quoted", lambda f: _train(f, "--data.blend", f'[["1", {f["good"]}]]'),
     ["data.blend", "good_text_document'] must be [weight, prefix], its weight a number (unquoted)"]),
    ("blend-shape", lambda f: _train(f, "--data.blend", "[1, 2, 3]"), ["data.blend"]),
    # its own files (no link to find), the same tokens: each of its samples served twice
    ("blend-copy", lambda f: _train(f, "--data.blend", f"[[0.5, {f['good']}], [0.2, {f['recorded']}], "
                                                       f"[0.5, {f['copied']}]]"),
     ["data.blend: ", "copied_text_document holds the tokens of ", "good_text_document (a copy: the same index, the "
      "same tokens); list it once, with the weights summed"]),
    ("blend-preset", lambda f: _train(f, "--data.blend", "null", "--data.blend_preset", "nope",
                                      "--data.blend_root", str(f["root"])), ["nope"]),
    ("blend-root-missing", lambda f: _train(f, "--data.blend", "null", "--data.blend_preset", "mtnlg530b",
                                            "--data.blend_root", str(f["root"] / "nope")),  # not 15 missing shards
     ["data.blend_root: ", "nope is not a directory", "data.blend_preset mtnlg530b"]),
    ("blend-root-file", lambda f: _train(f, "--data.blend", "null", "--data.blend_preset", "mtnlg530b",
                                         "--data.blend_root", str(f["root"] / "notes.txt")),  # a file, not a folder
     ["data.blend_root: ", "notes.txt is not a directory", "data.blend_preset mtnlg530b"]),
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
    ("shard-no-documents", lambda f: _train(f, prefix=f["nodocs"]),
     ["data.blend:", "nodocs_text_document holds no documents; preprocess it again, or leave it out of the blend"]),
    ("data-seed", lambda f: _train(f, "--data.seed", "-5"), ["data.seed: -5 is outside"]),
    # --- tokenizers -----------------------------------------------------------------------------
    ("tokenizer-missing", lambda f: _train(f, "--data.tokenizer", str(f["root"] / "nope.model")),
     ["data.tokenizer", "nope.model"]),
    ("tokenizer-empty-path", lambda f: _train(f, "--data.tokenizer", ""),
     ["data.tokenizer: an empty path names no tokenizer file (it would be read as the current directory); give "]),
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
    # another run directory, but the checkpoints of a live job: both would save into them
    ("run-dir-live-other-config", lambda f: _train(f, "--logging.run_dir", f["live"], "--model.num_layers", "4"),
     ["run directory is in use by pid", "logging.run_dir"]),  # not the live run's checkpoint's layers
    ("save-dir-locked", lambda f: _train(f, "--checkpoint.save_dir", f["locked"]),
     ["checkpoint directory is in use by pid", "give this job another checkpoint.save_dir"]),
    # --- checkpoints ----------------------------------------------------------------------------
    ("load-missing", lambda f: _train(f, "--checkpoint.load", str(f["root"] / "nockpt")), ["nockpt", "checkpoint.load"]),
    ("load-empty-dir", lambda f: _train(f, "--checkpoint.load", str(f["root"] / "locked")), ["holds no complete checkpoint"]),
    ("load-partial", lambda f: _train(f, "--checkpoint.load", f["partial"]), ["not a complete checkpoint"]),
    ("load-flipped", lambda f: _train(f, "--checkpoint.load", f["flipped"]), ["rank_00000.safetensors", "corrupted"]),
    # --check stats every file, as the launch does before it loads (the checksums are left to the load)
    ("load-cut-check", lambda f: _train(f, "--checkpoint.load", f["cut"], "--check"),
     ["checkpoint.load: ", "rank_00000.safetensors: 100 bytes but the checkpoint manifest records",
      "the file is truncated or was modified"]),
    ("save-dir-cut-check", lambda f: _train(f, "--checkpoint.save_dir", str(Path(f["cut"]).parent), "--check"),
     ["checkpoint.save_dir: ", "rank_00000.safetensors: 100 bytes", "(to resume from the checkpoint before it "
      "instead, move"]),
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
    ("load-run-dir", lambda f: _train(f, "--checkpoint.load", f["run"]),
     ["trained: holds no complete checkpoint, but", "trained/checkpoints does (a run directory keeps its checkpoints "
      "there); give that as checkpoint.load"]),
    ("load-empty-path", lambda f: _train(f, "--checkpoint.load", ""),
     ["checkpoint.load: an empty path names no checkpoint (it would be read as the current directory)"]),
    ("load-old-format", lambda f: _train(f, "--checkpoint.load", f["pickled"]), ["format"]),
    ("load-other-model", lambda f: _train(f, "--checkpoint.load", f["ckpt"], "--model.hidden_size", "64"),
     ["different model", "model.hidden_size"]),
    ("load-other-norm-eps", lambda f: _train(f, "--checkpoint.load", f["ckpt"], "--model.norm_eps", "1e-6"),
     ["different model", "model.norm_eps"]),
    # a model without biases would load the checkpoint's other weights and silently leave its biases behind
    ("load-without-bias", lambda f: _train(f, "--checkpoint.load", f["ckpt"], "--model.bias", "false"),
     ["different model", "model.bias"]),
    # an untied head would start from a fresh matrix; another context or kv-head count reshapes weights
    ("load-untied", lambda f: _train(f, "--checkpoint.load", f["ckpt"], "--model.tie_embeddings", "false"),
     ["different model", "model.tie_embeddings"]),
    ("load-other-seq-length", lambda f: _train(f, "--checkpoint.load", f["ckpt"], "--model.seq_length", "32"),
     ["different model", "model.seq_length"]),
    ("load-other-kv-heads", lambda f: _train(f, "--checkpoint.load", f["ckpt"], "--model.num_kv_heads", "2"),
     ["different model", "model.num_kv_heads"]),
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
    ("generate-run-dir", lambda f: ["generate", f["run"], "--tokenizer", str(f["root"] / "tokenizer.json")],
     ["trained: holds no complete checkpoint, but", "trained/checkpoints does", "give that as the CHECKPOINT argument"]),
    ("generate-a-checkpoints-file", lambda f: ["generate", str(Path(f["ckpt"]) / "COMPLETE"), "--tokenizer",
                                               str(f["root"] / "tokenizer.json")],
     ["step_0000001/COMPLETE: is a file, not a checkpoint directory; give the checkpoint holding it (",
      "step_0000001) as the CHECKPOINT argument"]),
    ("generate-unknown-option", lambda f: ["generate", f["ckpt"], "--tokenizer", str(f["root"] / "tokenizer.json"),
                                           "--top-p", "0.9"],
     ["megazero generate: error: unrecognized arguments: --top-p 0.9"]),  # with generate's usage, not megazero's
    ("encode-unknown-option", lambda f: ["tokenizer", "encode", "--tokenizer", str(f["root"] / "tokenizer.json"), "x",
                                         "--bogus"], ["megazero tokenizer encode: error: unrecognized arguments: --bogus"]),
    ("generate-empty-checkpoint", lambda f: ["generate", "", "--tokenizer", str(f["root"] / "tokenizer.json")],
     ["an empty path names no checkpoint (it would be read as the current directory); check the CHECKPOINT argument"]),
    ("generate-empty-tokenizer", lambda f: ["generate", f["ckpt"], "--tokenizer", ""],
     ["an empty path names no tokenizer file (it would be read as the current directory); give a SentencePiece .model file"]),
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
                                ("latin1", 2, ["not UTF-8"]), ("array", 1, ["starts a JSON array"])]],
    ("preprocess-cut-gz", lambda f: ["preprocess", "--input", str(f["root"] / "cut.jsonl.gz"), "--tokenizer",
                                     str(f["root"] / "tokenizer.json"), "--output-prefix", str(f["root"] / "out" / "cut"),
                                     "--no-progress"], ["cut.jsonl.gz"]),
    ("preprocess-plain-named-gz", lambda f: ["preprocess", "--input", str(f["root"] / "good.jsonl"),
                                             str(f["root"] / "plain.jsonl.gz"), "--tokenizer",
                                             str(f["root"] / "tokenizer.json"), "--output-prefix",
                                             str(f["root"] / "out" / "plain"), "--no-progress"],
     ["plain.jsonl.gz: not gzip data (it starts with b'{\"te'), though named .gz; rename it"]),
    ("preprocess-gz-cut-in-its-header", lambda f: ["preprocess", "--input", str(f["root"] / "good.jsonl"),
                                                   str(f["root"] / "stub.jsonl.gz"), "--tokenizer",
                                                   str(f["root"] / "tokenizer.json"), "--output-prefix",
                                                   str(f["root"] / "out" / "stub"), "--no-progress"],
     ["stub.jsonl.gz: only 2 byte(s), too short for gzip data; the file is truncated"]),
    ("preprocess-gz-named-plain", lambda f: ["preprocess", "--input", str(f["root"] / "good.jsonl"),
                                             str(f["root"] / "packed.jsonl"), "--tokenizer",
                                             str(f["root"] / "tokenizer.json"), "--output-prefix",
                                             str(f["root"] / "out" / "packed"), "--no-progress", "--skip-bad-records"],
     ["packed.jsonl: gzip data", "though not named .gz, so it would be read as text; rename it packed.jsonl.gz"]),
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
    ("tokenizer-train-input-twice", lambda f: ["tokenizer", "train", "--input", str(f["root"] / "good.jsonl"),
                                               f"{f['root']}/./good.jsonl", "--model-prefix", str(f["root"] / "tw")],
     ["good.jsonl is listed twice (also as", "its text would count twice"]),
    # every input and the output's folder, before the first input is read
    ("tokenizer-train-missing-input", lambda f: ["tokenizer", "train", "--input", str(f["root"] / "good.jsonl"),
                                                 str(f["root"] / "none.jsonl"), "--model-prefix", str(f["root"] / "tk")],
     ["--input ", "none.jsonl: no such file"]),
    ("tokenizer-train-input-folder", lambda f: ["tokenizer", "train", "--input", str(f["root"] / "emptydir"),
                                                "--model-prefix", str(f["root"] / "tk")],
     ["--input ", "emptydir: is a folder; give the text or .jsonl files in it"]),
    ("tokenizer-train-input-empty-path", lambda f: ["tokenizer", "train", "--input", "", "--model-prefix",
                                                    str(f["root"] / "tk")],
     ["--input: an empty path names no input file"]),
    ("tokenizer-train-plain-named-gz", lambda f: ["tokenizer", "train", "--input", str(f["root"] / "plain.jsonl.gz"),
                                                  "--model-prefix", str(f["root"] / "tk")],
     ["--input ", "plain.jsonl.gz: not gzip data", "rename it"]),
    ("tokenizer-train-prefix-under-a-file", lambda f: ["tokenizer", "train", "--input", str(f["root"] / "good.jsonl"),
                                                       "--model-prefix", str(f["root"] / "afile" / "tk")],
     ["--model-prefix ", "afile is a file, not a folder; choose another --model-prefix"]),
    ("tokenizer-train-prefix-unmakeable", lambda f: ["tokenizer", "train", "--input", str(f["root"] / "good.jsonl"),
                                                     "--model-prefix", "/proc/megazero/tk"],
     ["--model-prefix /proc/megazero/tk: cannot create /proc/megazero"]),
    ("preprocess-prefix-under-a-file", lambda f: ["preprocess", "--input", str(f["root"] / "good.jsonl"), "--tokenizer",
                                                  str(f["root"] / "tokenizer.json"), "--output-prefix",
                                                  str(f["root"] / "afile" / "g")],
     ["--output-prefix ", "afile is a file, not a folder"]),
    ("tokenizer-train-folder", lambda f: ["tokenizer", "train", "--input", str(f["root"] / "good.jsonl"),
                                          "--model-prefix", str(f["root"]) + "/"], ["names a folder"]),
    *[(f"tokenizer-train-{flag[2:]}-{value}", (lambda flag, value: lambda f: [
        "tokenizer", "train", "--input", str(f["root"] / "good.jsonl"), "--model-prefix", str(f["root"] / "out" / "tk"),
        flag, value])(flag, value), words) for flag, value, words in [
        ("--vocab-size", "10000000000", ["--vocab-size: must be at most 2147483647"]),
        ("--max-sentences", "-5", ["--max-sentences: must be between 101 and"]),
        ("--max-sentences", "100", ["--max-sentences: must be between 101 and 2147483647, got 100"]),
        ("--vocab-size", "5000", ["vocabulary size 5000 is more than this text can fill (at most", "more text"])]],
    *[(f"demo-corpus-max-mb-{text}", (lambda text: lambda f: [
        "demo-corpus", str(f["root"] / "out" / "demo"), "--max-mb", text])(text),
       [f"--max-mb: must be a positive number of MB, got {text}"]) for text in ("inf", "nan", "0.0")],
    ("demo-corpus-vocab-beyond-int32", lambda f: ["demo-corpus", str(f["root"] / "out" / "demo"), "--vocab-size",
                                                  "99999999999"], ["--vocab-size: must be at most 2147483647"]),
    ("demo-corpus-empty-path", lambda f: ["demo-corpus", ""],
     ["OUT_DIR: an empty path names no folder (it would be read as the current directory); give a folder"]),
    ("demo-corpus-exists", lambda f: ["demo-corpus", str(f["root"])], ["stdlib.jsonl: exists", "remove it first"]),
    ("demo-corpus-into-a-file", lambda f: ["demo-corpus", str(f["root"] / "good.jsonl" / "demo")],
     ["good.jsonl is a file, not a folder", "give a folder to build the demo corpus in"]),
    ("preprocess-workers", lambda f: ["preprocess", "--input", str(f["root"] / "good.jsonl"), "--tokenizer",
                                      str(f["root"] / "tokenizer.json"), "--output-prefix", str(f["root"] / "out" / "g"),
                                      "--workers", "0"], ["--workers"]),
    ("preprocess-prefix-folder", lambda f: ["preprocess", "--input", str(f["root"] / "good.jsonl"), "--tokenizer",
                                            str(f["root"] / "tokenizer.json"), "--output-prefix", str(f["root"] / "out") + "/"],
     ["--output-prefix", "names a folder; give a path and file-name prefix inside it"]),
    ("preprocess-prefix-existing-folder", lambda f: ["preprocess", "--input", str(f["root"] / "good.jsonl"), "--tokenizer",
                                                     str(f["root"] / "tokenizer.json"), "--output-prefix", str(f["root"])],
     ["--output-prefix", "names a folder; give a path and file-name prefix inside it"]),
    # refused with the other flags: it was found as the first record was read, as that record's missing field
    ("preprocess-empty-json-key", lambda f: ["preprocess", "--input", str(f["root"] / "good.jsonl"), "--tokenizer",
                                             str(f["root"] / "tokenizer.json"), "--output-prefix",
                                             str(f["root"] / "out" / "g"), "--json-keys", ""],
     ["--json-keys: an empty field name names no field of a record; give the field to tokenize"]),
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


def test_the_reliability_page_counts_the_table():
    """docs/reliability.md tells a user how many bad inputs are held to one line; the number must be
    this table's (it once said 159 when the table held 163)."""
    import re

    page = (Path(__file__).resolve().parent.parent / "docs" / "reliability.md").read_text(encoding="utf-8")
    stated = re.search(r"`tests/test_bad_inputs.py` holds the table: (\d+) bad inputs", page)
    assert stated, "docs/reliability.md no longer says how many bad inputs tests/test_bad_inputs.py holds"
    assert int(stated.group(1)) == len(CASES)
