"""What a relaunch decides before it trains: which checkpoint it starts from, a first save left
unfinished, the tokenizer a checkpoint records, and what a resume would change in the data it reads
(shards gone or rewritten, another blend rule, another data-parallel size during a batch ramp-up).
Each case runs the real ``megazero`` command line in this process on the files of
``tests/bad_input_files.py``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.indexed import IndexedDatasetWriter
from megazero.cli import main
from tests.bad_input_files import VOCAB, _model, _train, make_files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_files(tmp_path_factory.mktemp("inputs"))


def test_an_unfinished_first_save_is_said_and_the_record_kept(files, capsys):
    """A run whose checkpoints all died mid-save starts over, naming the newest; its metrics are kept, marked."""
    run = files["root"] / "unfinished"
    for step in (2, 10):
        (run / "checkpoints" / f"step_{step:07d}.tmp").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "lo')
    assert main(["train", *_model(files["good"], str(run)), "--train.train_steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "holds no complete checkpoint, only the unfinished save step_0000010.tmp; starting from step 0" in out
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
    assert "this run already finished at step 2; nothing to train (raise train.train_steps or train.train_tokens " \
           "to train on, or use another logging.run_dir)" in out, out
    # a finished run's checkpoints started from elsewhere: another logging.run_dir is no way out there
    # (planted: the message above for each, which the user had already followed)
    saved = str(run / "checkpoints")
    argv = ["train", *_model(files["good"], str(files["root"] / "other")), "--checkpoint.load", saved]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"checkpoint.load {saved} is at step 2, where this run ends; nothing to train (raise train.train_steps " \
           f"or train.train_tokens to train on, or start a new run from its weights: `megazero convert {saved} DST " \
           "--to megazero --reset-step`, then checkpoint.load DST)" in out, out
    argv = ["train", *_model(files["good"], str(files["root"] / "third")), "--checkpoint.save_dir", saved]
    assert main(argv) == 0
    assert f"checkpoint.save_dir {saved} holds a run that finished at step 2; nothing to train (raise " \
           "train.train_steps or train.train_tokens to train on, or give a new run another checkpoint.save_dir)" \
           in capsys.readouterr().out


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
    named_ckpt = tmp_path / "named" / "checkpoints" / "step_0000001"  # a run that named its tokenizer says where
    assert main(["generate", str(named_ckpt), "--tokenizer", other, "--tokens", "2"]) == 2
    assert f"{VOCAB} tokens, sha256 {mine['tokenizer_sha256'][:12]}), at {tok} when it trained;" in \
        capsys.readouterr().err
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
    for allow, code in (("config_changes", 2), ("tokenizer_change", 0)):  # only its own flag lets it through
        assert main([*resume, "--data.tokenizer", other, f"--checkpoint.allow_{allow}", "true", "--check"]) == code
    assert "(step 1) was trained on ids of tokenizer.json" in capsys.readouterr().err
    assert main(resume) == 0  # ...and data that names none keeps the checkpoint's record
    assert read_manifest(tmp_path / "on" / "checkpoints" / "step_0000002")["meta"]["tokenizer"] == mine


def test_a_checkpoint_reset_to_step_0_still_refuses_another_tokenizer(files, capsys, tmp_path):
    """`convert --reset-step` keeps the weights and their tokenizer record at step 0, where no data
    order or schedule is compared: the tokenizer still is, or the weights learn other pieces' ids
    without a word (it was skipped with the rest at step 0)."""
    tok, other = str(files["root"] / "tokenizer.json"), str(files["root"] / "other_tokenizer.json")
    run = tmp_path / "trained"
    assert main(["train", *_model(files["good"], str(run)), "--train.train_steps", "1", "--data.tokenizer", tok]) == 0
    assert main(["convert", str(run / "checkpoints"), str(tmp_path / "reset"), "--to", "megazero",
                 "--reset-step"]) == 0
    resume = ["train", *_model(files["good"], str(tmp_path / "on")), "--checkpoint.load", str(tmp_path / "reset")]
    capsys.readouterr()
    assert main([*resume, "--data.tokenizer", other, "--check"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(step 0) was trained on ids of tokenizer.json" in err[0], err
    assert "checkpoint.allow_tokenizer_change true" in err[0], err
    assert main([*resume, "--data.tokenizer", tok, "--check"]) == 0


def test_a_tokenizer_record_without_its_digest_identifies_nothing():
    """Only a record with the tokenizer's sha256 identifies it: a name and a size could match another."""
    from megazero.data import recorded_tokenizer

    assert recorded_tokenizer({"tokenizer": {"name": "tokenizer.json", "vocab_size": VOCAB}}) is None
    assert recorded_tokenizer({"tokenizer": {"tokenizer_sha256": "ab" * 32}}) is not None


def test_a_resume_with_the_same_data_spelled_otherwise_passes(files, capsys):
    """The data order is compared by the files a blend names, not by how their paths are written."""
    prefix = files["good"].replace("/good_text_document", "/./good_text_document")
    assert prefix != files["good"]
    code = main(_train(files, "--checkpoint.load", files["ckpt"], "--check", prefix=prefix))
    assert code == 0, capsys.readouterr().err


def test_a_resume_with_the_same_split_spelled_otherwise_passes(files, capsys):
    """The split is compared by the shares it gives, which alone place the documents: the checkpoint's
    ``1`` is ``1,0,0`` or ``2``, whereas ``1,1`` halves the training documents. (Planted: the split's
    text compared, which refused the respelled split as another data order.)"""
    for same in ("1,0,0", "2"):
        code = main(_train(files, "--checkpoint.load", files["ckpt"], "--check", "--data.split", same))
        assert code == 0, (same, capsys.readouterr().err)
    assert main(_train(files, "--checkpoint.load", files["ckpt"], "--check", "--data.split", "1,1")) == 2
    assert "another data order (data.split changed)" in capsys.readouterr().err


def test_only_the_reporting_ranks_look_at_every_checkpoint_file(files):
    """Every rank of a launch runs the checks, and a stat of every rank's file on every rank is world²
    requests to a shared filesystem: the ranks that report (rank 0, and each node's first on several
    nodes) and ``--check`` look at each file; the others leave a file cut short to their load.
    (Planted: the files looked at on every rank; only on rank 0, though a node's first also reports.)"""
    from types import SimpleNamespace

    from megazero.commands.train import checked_config
    from megazero.errors import ConfigError
    from parallel.launch import LaunchEnv

    overrides = _train(files, "--checkpoint.load", files["cut"])[1:]
    for launch, check, refused in ((LaunchEnv(1, 2, 1, 2), False, False), (LaunchEnv(0, 2, 0, 2), False, True),
                                   (LaunchEnv(1, 2, 1, 2), True, True), (LaunchEnv(1, 2, 0, 1), False, True)):
        args = SimpleNamespace(overrides=overrides, check=check)
        if refused:
            with pytest.raises(ConfigError, match="the file is truncated"):
                checked_config(args, launch)
        else:
            checked_config(args, launch)


def test_a_checkpoint_that_records_no_shards_resumes(files, capsys):
    """Checkpoints written before shards were recorded hold no digests: they have nothing to compare,
    and a resume from one must go on, not be refused as if every shard had been rewritten."""
    from megazero.checkpoint.format import CHECKSUM, complete_text

    argv = ["train", *_model(files["good"], str(files["root"] / "unrecorded"))]
    assert main([*argv, "--train.train_steps", "1"]) == 0
    path = files["root"] / "unrecorded/checkpoints/step_0000001/COMPLETE"
    record = json.loads(path.read_text())
    record.pop(CHECKSUM)
    del record["meta"]["shards"]  # as an older version wrote it
    path.write_text(complete_text(record))
    capsys.readouterr()
    assert main([*argv, "--train.train_steps", "2"]) == 0, capsys.readouterr().err


def test_a_resume_on_a_shard_gone_since_is_its_own_one_line(files, capsys):
    """A shard deleted since the checkpoint was written is said as the missing shard it is; comparing
    the checkpoint's shard digests must leave it to that check, not end in a traceback of its own."""
    prefix = str(files["root"] / "gone_text_document")
    for name in (".bin", ".idx"):
        shutil.copy(files["good"] + name, prefix + name)
    argv = ["train", *_model(prefix, str(files["root"] / "gone"))]
    assert main([*argv, "--train.train_steps", "1"]) == 0
    os.remove(prefix + ".idx")
    capsys.readouterr()
    assert main([*argv, "--train.train_steps", "2"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err and all(line.startswith("megazero train: error: ") for line in err), err
    assert any("gone_text_document" in line for line in err), err


def test_a_resume_on_a_shard_rewritten_in_place_is_refused(files, capsys):
    """A shard preprocessed again at its path kept every checked name, so the resumed run counted its
    samples consumed through other documents without a word; checkpoints now record each shard's
    .idx digest."""
    prefix = str(files["root"] / "inplace_text_document")
    for name in (".bin", ".idx"):
        shutil.copy(files["good"] + name, prefix + name)
    argv = ["train", *_model(prefix, str(files["root"] / "inplace"))]
    assert main([*argv, "--train.train_steps", "1"]) == 0
    meta = json.loads((files["root"] / "inplace/checkpoints/step_0000001/COMPLETE").read_text())["meta"]
    assert list(meta["shards"]) == [os.path.realpath(prefix)]
    with IndexedDatasetWriter(prefix, np.uint16) as w:  # other documents at the same path
        for i in range(64):
            w.add_document(np.full(80 + (i % 2), 1 + i % 7, np.uint16))
    capsys.readouterr()
    # also named otherwise (planted: the shards recorded and compared by the path as written, which
    # took a respelled path for a shard the checkpoint never saw, and passed)
    respelled = ["train", *_model(prefix.replace("/inplace_text", "/./inplace_text"), str(files["root"] / "inplace"))]
    for args in (argv, respelled):
        assert main([*args, "--train.train_steps", "2"]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"was trained on other contents of {os.path.realpath(prefix)}" in err[0], err
    assert main([*argv, "--train.train_steps", "2", "--checkpoint.allow_config_changes", "true"]) == 0


def test_a_resume_on_a_shard_of_equal_documents_reordered_is_refused(files, capsys):
    """Documents of one length (a pre-chunked corpus) written again in another order give the same
    .idx bytes, so the digest the checkpoint recorded passed (planted: the tokens not recorded);
    the tokens' digest tells them apart."""
    prefix = str(files["root"] / "reordered_text_document")
    for name in (".bin", ".idx"):
        shutil.copy(files["good"] + name, prefix + name)
    argv = ["train", *_model(prefix, str(files["root"] / "reordered"))]
    assert main([*argv, "--train.train_steps", "1"]) == 0
    from data_pipeline.indexed import IndexedDataset

    documents = [IndexedDataset(prefix)[i].copy() for i in range(64)]
    idx = open(prefix + ".idx", "rb").read()
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for document in reversed(documents):
            w.add_document(document)
    assert open(prefix + ".idx", "rb").read() == idx
    capsys.readouterr()
    assert main([*argv, "--train.train_steps", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"was trained on other contents of {os.path.realpath(prefix)} (its tokens changed " \
        "since, its .idx not: documents of equal lengths in another order?)" in err[0], err


def test_a_resume_drawn_by_the_older_blend_rule_is_refused(files, capsys, tmp_path):
    """Rule 1 of the blend gave a weight-0 dataset listed first one sample, and rule 2 none, so a
    checkpoint of rule 1 (one that records no rule) with such a blend would go on in another order
    without a word; a checkpoint of the current rule, or of a blend the rules draw alike, resumes.
    (Planted: no rule compared; the rule not recorded at save, or not carried by convert; nor the
    shards' digests or the sample count, which a resume compares as well.)"""
    from megazero.checkpoint.format import CHECKSUM, complete_text, read_manifest

    blend = f"[[0, {files['recorded']}], [1, {files['good']}]]"
    run = tmp_path / "run"
    argv = ["train", *_model(files["good"], str(run)), "--data.blend", blend]
    assert main([*argv, "--train.train_steps", "1"]) == 0
    step = run / "checkpoints" / "step_0000001"
    resume = [*argv, "--checkpoint.load", str(step), "--logging.run_dir", str(tmp_path / "on"), "--check"]
    capsys.readouterr()
    assert main(resume) == 0, capsys.readouterr().err
    assert main(["convert", str(step), str(tmp_path / "resharded"), "--to", "megazero"]) == 0
    resharded = read_manifest(next((tmp_path / "resharded").glob("step_*")))["meta"]
    original = read_manifest(step)["meta"]
    for key in ("blend_rule", "shards", "shard_tokens", "train_samples"):  # what a resume compares
        assert resharded[key] == original[key], key
    record = read_manifest(step)
    assert record["meta"].pop("blend_rule") == 2
    (step / "COMPLETE").write_text(complete_text({k: v for k, v in record.items() if k != CHECKSUM}))
    assert main(resume) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(step 1) drew its blend by an older rule, which took one sample of" in err[0], err
    assert "checkpoint.allow_config_changes true to go on in the new order" in err[0], err
    assert main([*resume, "--checkpoint.allow_config_changes", "true"]) == 0
    swapped = ["--data.blend", f"[[1, {files['good']}], [0, {files['recorded']}]]", "--checkpoint.allow_config_changes",
               "false"]
    capsys.readouterr()
    assert main([*resume, *swapped]) == 2  # another blend is its own change...
    assert "another data order (data.blend changed)" in capsys.readouterr().err


def test_a_resume_at_another_dp_during_the_batch_ramp_up_is_refused(files, capsys, monkeypatch, tmp_path):
    """The ramp-up rounds each step's batch to a multiple of micro_batch_size x dp: a checkpoint of dp 1
    at sample 2 of a ramp from 2 resumed at dp 2 would train its next step on 4 samples, not 2, and
    group every sample ahead into other steps without a word. The same dp resumes; changing the batch
    settings themselves is a change the config states. (Planted: no batch comparison.)"""
    ramp = ["--train.global_batch_size", "8", "--schedule.rampup_start_batch", "2", "--schedule.rampup_increment",
            "2", "--schedule.rampup_samples", "64"]
    run = tmp_path / "run"
    argv = ["train", *_model(files["good"], str(run)), *ramp]
    assert main([*argv, "--train.train_steps", "1"]) == 0
    resume = [*argv, "--checkpoint.load", str(run / "checkpoints" / "step_0000001"), "--logging.run_dir",
              str(tmp_path / "on"), "--check"]
    capsys.readouterr()
    assert main(resume) == 0, capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert main(resume) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(step 1) would train the step at sample 2 on a global batch of 4 instead of 2" in err[0]
    assert "parallel.dp changed" in err[0], err
    assert main([*resume, "--schedule.rampup_start_batch", "4"]) == 0, capsys.readouterr().err


def test_a_resume_at_a_smaller_global_batch_builds_the_samples_it_draws(files, capsys):
    """Two steps of 8 samples, then two more of 4: the run draws 24 samples, and its indices were built
    for train_steps x global_batch_size, 16, so the first step past them stopped on a traceback
    (planted: the count without the samples consumed). The checkpoint records the count it built for,
    which the next resume compares its own with."""
    run = str(files["root"] / "cut_batch")
    argv = ["train", *_model(files["good"], run), "--schedule.warmup_steps", "0", "--schedule.decay_steps", "100"]
    assert main([*argv, "--train.global_batch_size", "8"]) == 0
    capsys.readouterr()
    assert main([*argv, "--train.train_steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "finished at step 4 (24 samples" in out, out
    record = json.loads((Path(run) / "checkpoints" / "step_0000004" / "COMPLETE").read_text())
    assert record["meta"]["train_samples"] == 24 and record["meta"]["consumed"] == 24


def test_a_resume_at_a_smaller_batch_keeps_the_order_its_checkpoint_built(files, capsys, tmp_path):
    """A shard of 27 samples: 4 steps of 8 built indices for 32 (two epochs). Resumed at step 2 with
    batches of 4, the run draws 24 (one epoch's worth), and built for that it would reshuffle every
    sample, so the resume was refused; it now builds the 32 its checkpoint recorded, and keeps the
    order (planted: the recorded count not taken)."""
    prefix = str(tmp_path / "small_text_document")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for k in range(7):
            w.add_document((np.arange(64) * (k + 1)) % 60 + 1)
    run = str(tmp_path / "run")
    argv = ["train", *_model(prefix, run), "--schedule.warmup_steps", "0", "--schedule.decay_steps", "100",
            "--train.train_steps", "4"]
    assert main([*argv, "--train.global_batch_size", "8", "--checkpoint.save_interval", "2"]) == 0
    step = Path(run) / "checkpoints" / "step_0000002"
    capsys.readouterr()
    resume = [*argv, "--checkpoint.load", str(step), "--logging.run_dir", str(tmp_path / "on")]
    assert main(resume) == 0, capsys.readouterr().err
    record = json.loads((tmp_path / "on" / "checkpoints" / "step_0000004" / "COMPLETE").read_text())
    assert record["meta"]["train_samples"] == 32 and record["meta"]["consumed"] == 24
