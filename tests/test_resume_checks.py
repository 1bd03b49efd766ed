"""What a resume would change, compared between the config a checkpoint records and the run's own
(``megazero.resume_checks``), on configs alone: no data, checkpoint or process group."""

from __future__ import annotations

import dataclasses

import pytest

from megazero.config import load_config
from megazero.config.loader import config_to_dict
from megazero.resume_checks import _resume_changes, checkpoint_problems
from megazero.training_schedules import build_lr_schedule


def _config(*extra):
    return load_config(None, ["--train.train_steps", "10", "--schedule.warmup_steps", "2", "--train.device", "cpu",
                              *extra])


def test_the_learning_rate_compared_is_that_of_the_next_step_under_both_configs():
    """A checkpoint of step 4, mid-decay, resumed with its own config continues its schedule; a longer
    run would change the rate of step 5, which is what the message gives. (Planted: the checkpoint's
    rate taken at its own step, which refused every unchanged resume mid-decay; the launch tests'
    checkpoints sat where the rate was flat, so none saw it.)"""
    saved = _config()
    assert _resume_changes(config_to_dict(saved), saved, 4, 16) == []
    longer = _config("--train.train_steps", "20")
    (problem,) = _resume_changes(config_to_dict(saved), longer, 4, 16)
    was, will = (build_lr_schedule(c.optimizer, c.schedule, c.train)(5) for c in (saved, longer))
    assert was != pytest.approx(will)
    assert problem.startswith(f"would change the learning rate of step 5 from {was:.4g} to {will:.4g} "
                              "(train.train_steps changed"), problem


def test_the_decay_a_longer_run_is_told_to_keep_is_the_one_it_had():
    """A longer run is told the schedule.decay_steps that continues the checkpoint's decay: its steps
    after warm-up, and the resume so set passes (planted: the warm-up counted in, passed)."""
    saved, longer = _config(), ("--train.train_steps", "20")
    (problem,) = _resume_changes(config_to_dict(saved), _config(*longer), 4, 16)
    assert problem.endswith("(train.train_steps changed; to continue its decay, set schedule.decay_steps 8)"), problem
    assert _resume_changes(config_to_dict(saved), _config(*longer, "--schedule.decay_steps", "8"), 4, 16) == []


@pytest.mark.parametrize("change, field", [(("--optimizer.min_lr", "1e-6"), "optimizer.min_lr"),
                                           (("--schedule.decay_style", "linear"), "schedule.decay_style")])
def test_a_schedule_changed_during_warm_up_is_a_change(change, field):
    """Resumed during warm-up, a changed floor or decay style leaves the next step's rate alone and
    changes every rate after the warm-up: the first step whose rate differs is named. (Planted: the
    next step's rate alone compared, which passed both.)"""
    saved = _config("--schedule.warmup_steps", "5")
    assert _resume_changes(config_to_dict(saved), saved, 2, 8) == []
    (problem,) = _resume_changes(config_to_dict(saved), _config("--schedule.warmup_steps", "5", *change), 2, 8)
    assert problem.startswith("would change the learning rate of step ") and f"({field} changed)" in problem, problem
    assert not problem.startswith("would change the learning rate of step 3 ")


def test_a_learning_rate_a_few_percent_off_is_a_change():
    """Only rounding is forgiven: a peak rate 5% higher changes every step ahead, and is named."""
    saved = _config()
    nudged = _config("--optimizer.lr", repr(saved.optimizer.lr * 1.05))
    (problem,) = _resume_changes(config_to_dict(saved), nudged, 4, 16)
    assert problem.startswith("would change the learning rate of step 5") and "(optimizer.lr changed)" in problem


def _checkpoint(tmp_path, saved, step: int = 4, consumed: int = 16, shards: dict | None = None) -> str:
    """A checkpoint directory whose ``COMPLETE`` records ``saved`` as its run's config (and ``shards``'
    digests, where given) and no files: what the resume checks read, without training a step."""
    from megazero.checkpoint.format import FORMAT_VERSION, complete_text

    ckpt = tmp_path / f"step_{step:07d}"
    ckpt.mkdir(parents=True)
    meta = {"config": config_to_dict(saved), "step": step, "consumed": consumed, "skipped": 0,
            "layout": {"tp": 1, "pp": 1, "dp": 1}, **({"shards": shards} if shards else {})}
    record = {"format": FORMAT_VERSION, "step": step, "world_size": 1, "meta": meta, "files": {}}
    (ckpt / "COMPLETE").write_text(complete_text(record))
    return str(ckpt)


def _problems(tmp_path, saved, *now) -> list[str]:
    """What resuming the checkpoint of ``saved`` with the config of overrides ``now`` is refused for."""
    ckpt = _checkpoint(tmp_path, saved)
    return checkpoint_problems(_config("--checkpoint.load", ckpt, "--logging.run_dir", str(tmp_path / "run"), *now))


# Model fields a checkpoint may move across: they shape no parameter
NOT_ARCHITECTURE = {"preset", "dropout", "attention_dropout", "init_std"}
# A changed value for each field that shapes or gives meaning to parameters (rotary: its base counts)
CHANGED = {"num_layers": "4", "hidden_size": "128", "num_heads": "8", "num_kv_heads": "2", "ffn_hidden_size": "96",
           "vocab_size": "1024", "seq_length": "64", "position_embedding": "learned", "rope_theta": "500000",
           "norm": "rmsnorm", "norm_eps": "1e-6", "activation": "swiglu", "tie_embeddings": "false",
           "bias": "false"}


def test_every_field_that_shapes_the_model_refuses_a_resume(tmp_path):
    """Each model field but dropout and initialisation decides what the checkpoint's weights are: a
    resume that changes one is refused naming it, and one that changes none passes. The fields are
    those of the model's config, so one added there is covered or must be named here. (Planted:
    rope_theta, activation or norm left out of the compared fields, each passed every other test.)"""
    import dataclasses

    from models.config import ModelConfig

    assert set(CHANGED) == {f.name for f in dataclasses.fields(ModelConfig)} - NOT_ARCHITECTURE
    saved = _config("--model.position_embedding", "rope")
    assert _problems(tmp_path / "same", saved, "--model.position_embedding", "rope") == []
    for name, value in CHANGED.items():
        (problem,) = _problems(tmp_path / name, saved, "--model.position_embedding", "rope", f"--model.{name}", value)
        assert f"was trained with a different model (model.{name})" in problem, (name, problem)


def test_blend_weights_are_compared_as_the_shares_they_give(tmp_path):
    """Weights are relative: a blend written with every weight doubled draws the same order and
    resumes, while another share of one dataset is refused (planted: weights compared as written,
    which refused the first, passed)."""
    saved = _config("--data.blend", "[[1, a], [3, b]]")
    assert _problems(tmp_path / "doubled", saved, "--data.blend", "[[2, a], [6, b]]") == []
    (problem,) = _problems(tmp_path / "other", saved, "--data.blend", "[[1, a], [1, b]]")
    assert "was trained on another data order (data.blend changed)" in problem, problem


@pytest.mark.parametrize("change, said", [
    (lambda meta: meta.pop("layout"), "its COMPLETE's meta has no layout record (layout None)"),
    (lambda meta: meta.pop("consumed"), "its COMPLETE's meta has no consumed"),
    (lambda meta: meta.update(consumed="16"), "its COMPLETE's meta holds consumed '16', not a whole number"),
    (lambda meta: meta.update(skipped=-1), "its COMPLETE's meta holds skipped -1, not a whole number"),
])
def test_a_record_without_what_a_resume_reads_is_one_line(tmp_path, change, said):
    """A ``COMPLETE`` resealed by hand (or by a tool that got the format wrong) passed ``--check``, then
    the launch stopped at its start with a KeyError or TypeError traceback. (Planted: the check left out.)"""
    from megazero.checkpoint.format import complete_text, read_manifest

    saved = _config()
    ckpt = _checkpoint(tmp_path, saved)
    record = read_manifest(ckpt)
    change(record["meta"])
    (tmp_path / "step_0000004" / "COMPLETE").write_text(complete_text(record))
    (problem,) = checkpoint_problems(_config("--checkpoint.load", ckpt, "--logging.run_dir", str(tmp_path / "run")))
    assert said in problem and "which a resume reads" in problem, problem


def test_shards_moved_to_another_path_resume_by_their_recorded_contents(tmp_path):
    """Shards copied to another mount or cluster order the samples exactly as before: where the
    checkpoint recorded their ``.idx`` digests they are compared by contents, not path (they were
    refused as "data.blend changed", and the only way on switched off every other check); other
    contents at the new path are still another data order. (Planted: datasets compared by path.)"""
    import shutil

    import numpy as np

    from data_pipeline.indexed import IndexedDatasetWriter
    from megazero.data import shard_digests

    first = str(tmp_path / "a" / "web")
    (tmp_path / "a").mkdir()
    with IndexedDatasetWriter(first, np.uint16) as w:
        for k in range(8):
            w.add_document(np.arange(1, 30 + k, dtype=np.uint16))
    (tmp_path / "b").mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(first + ext, tmp_path / "b" / f"web{ext}")
    saved = _config("--data.blend", f"[[1, {first}]]")
    ckpt = _checkpoint(tmp_path / "ck", saved, shards=shard_digests(saved))
    now = ("--checkpoint.load", ckpt, "--logging.run_dir", str(tmp_path / "run"))
    moved = str(tmp_path / "b" / "web")
    assert checkpoint_problems(_config(*now, "--data.blend", f"[[1, {moved}]]")) == []
    with IndexedDatasetWriter(moved, np.uint16) as w:  # preprocessed again: other documents
        w.add_document(np.arange(1, 30, dtype=np.uint16))
    (problem,) = checkpoint_problems(_config(*now, "--data.blend", f"[[1, {moved}]]"))
    assert "was trained on another data order (data.blend changed)" in problem, problem


def test_the_epoch_check_of_a_blend_probes_the_shares_within_one(tmp_path):
    """A blend's greedy share of n samples is within one of weight x n: the check asks for each count
    in that range and no other. At half of 319 samples an epoch, 636 and 637 samples give shares of
    317 to 319, one epoch either way, and resume; 638 may give 320, a second epoch, and is refused.
    (Planted: the exact share alone, passed; a probe at two above it refused the first.)"""
    import numpy as np

    from data_pipeline.indexed import IndexedDatasetWriter
    from megazero.resume_checks import _epochs_change

    prefix = str(tmp_path / "data")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(64):
            w.add_document(np.ones(80, np.uint16))  # 5120 tokens: 319 samples of 16 + 1
    cfg = _config("--model.seq_length", "16", "--data.split", "1")
    assert _epochs_change(prefix, 0.5, cfg, 636, 637) is False
    assert _epochs_change(prefix, 0.5, cfg, 636, 638) is True


def test_a_checkpoint_that_records_no_tokenizer_resumes_on_data_that_names_one(monkeypatch):
    """An older checkpoint, or one imported from another framework, records no tokenizer: there is
    nothing to compare, and data that names one resumes; a record of another is refused. (Planted:
    the absent record compared, passed.)"""
    import megazero.data
    from megazero.resume_checks import _tokenizer_change

    mine, other = ({"tokenizer": name, "vocab_size": 512, "tokenizer_sha256": digit * 64} for name, digit in
                   (("mine.json", "a"), ("other.json", "b")))
    monkeypatch.setattr(megazero.data, "tokenizer_record", lambda cfg: mine)
    assert _tokenizer_change({"step": 4}, _config()) == []
    assert _tokenizer_change({"step": 4, "tokenizer": mine}, _config()) == []
    (problem,) = _tokenizer_change({"step": 4, "tokenizer": other}, _config())
    assert problem.startswith("was trained on ids of other.json (512 tokens"), problem


def test_a_config_of_another_schema_still_has_its_data_order_compared():
    """A checkpoint written by a version with other config fields cannot be rebuilt as this version's
    config, but the data fields both name still say whether the sample order changed. (Planted: no
    field compared there, passed.)"""
    saved = config_to_dict(_config())
    saved["train"]["retired_field"] = 1
    assert _resume_changes(saved, _config(), 4, 16) == []
    assert _resume_changes(saved, _config("--data.seed", "7"), 4, 16) == [
        "was trained on another data order (data.seed changed)"]


@pytest.mark.parametrize("recorded, now", [("969,30,1,", "969,30,1"), ("98,,2", "98,2")])
def test_a_split_recorded_with_an_empty_part_is_read_as_its_version_read_it(recorded, now):
    """Versions that skipped an empty part of ``data.split`` recorded it so in their checkpoints; now
    refused, the corrected split was then taken for another data order (planted: the recorded text
    compared as text)."""
    from megazero.resume_checks import _split_shares

    old = _config()
    old = dataclasses.replace(old, data=dataclasses.replace(old.data, split=recorded))
    assert _split_shares(old) == _split_shares(_config("--data.split", now))
