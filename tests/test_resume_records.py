"""Resumes from what a checkpoint recorded: a blend entry whose link now leads elsewhere, a record of
another version's config, and the record a finished run keeps when relaunched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.indexed import IndexedDatasetWriter
from megazero.cli import main
from tests.bad_input_files import _model, make_files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_files(tmp_path_factory.mktemp("inputs"))


def test_a_resume_through_a_link_pointed_elsewhere_is_refused(files, capsys):
    """The blend names data/current/..., a link the user pointed at another corpus after the
    checkpoint: the blend's text and every shard recorded were unchanged, and the run resumed on
    other documents without a word (the saved config's paths were resolved today, through the new
    link). The entries are now compared where the checkpoint recorded them. A link pointed at a copy
    of the same shard still resumes. (Planted: the saved paths resolved today.)"""
    root = files["root"] / "linked"
    for version in ("v1", "v2", "copy"):
        (root / version).mkdir(parents=True)
    for name in (".bin", ".idx"):
        shutil.copy(files["good"] + name, str(root / "v1" / "web") + name)
        shutil.copy(files["good"] + name, str(root / "copy" / "web") + name)
    with IndexedDatasetWriter(str(root / "v2" / "web"), np.uint16) as w:  # another corpus
        for i in range(64):
            w.add_document(np.full(80 + (i % 2), 1 + i % 7, np.uint16))
    (root / "current").symlink_to("v1")
    argv = ["train", *_model(str(root / "current" / "web"), str(root / "run"))]
    assert main([*argv, "--train.train_steps", "1"]) == 0
    (root / "current").unlink()
    (root / "current").symlink_to("copy")
    capsys.readouterr()
    assert main([*argv, "--train.train_steps", "2", "--check"]) == 0, capsys.readouterr().err
    (root / "current").unlink()
    (root / "current").symlink_to("v2")
    assert main([*argv, "--train.train_steps", "2"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert (f"was trained on {root / 'v1' / 'web'}, and the same blend entry now leads to {root / 'v2' / 'web'}, "
            "other contents") in err[0], err


def _reseal(step_dir: Path, edit) -> None:
    """A checkpoint's COMPLETE record edited and sealed again, as another version would have written it."""
    from megazero.checkpoint.format import CHECKSUM, complete_text

    path = step_dir / "COMPLETE"
    record = json.loads(path.read_text())
    record.pop(CHECKSUM)
    edit(record["meta"]["config"])
    path.write_text(complete_text(record))


def test_a_field_of_another_version_leaves_every_resume_check_on(files, capsys):
    """A checkpoint whose record holds a config field this version has dropped (one version recorded
    parallel.tp_sm_carveout): the saved config no longer built, and the resume fell back to comparing
    the data fields alone, so a jump in the learning rate resumed without a word. Sampling was refused
    naming a field the user never set. (Planted: the record built as written.)"""
    from megazero.checkpoint import CheckpointError
    from megazero.generate import load_model

    runs = {name: str(files["root"] / "skew" / name) for name in ("as_written", "other_version")}
    for run in runs.values():
        assert main(["train", *_model(files["good"], run), "--train.train_steps", "1"]) == 0
    step = Path(runs["other_version"]) / "checkpoints" / "step_0000001"
    _reseal(step, lambda config: config["parallel"].update(tp_sm_carveout=0))
    capsys.readouterr()
    said = {}
    for name, run in runs.items():
        assert main(["train", *_model(files["good"], run), "--train.train_steps", "4"]) == 2
        said[name] = capsys.readouterr().err.replace(run, "RUN")
    assert said["other_version"] == said["as_written"] and "learning rate" in said["as_written"], said
    assert load_model(step)[1].model.num_layers == 2
    _reseal(step, lambda config: config["model"].update(sliding_window=8))
    with pytest.raises(CheckpointError, match=r"its model sets model\.sliding_window, which this version of megazero "
                                              r"does not know"):
        load_model(step)


def test_a_finished_run_relaunched_shorter_keeps_its_config_record(files, capsys):
    """Asking a run that finished at step 2 for 1 step trains nothing, and its config.yaml still says
    what it trained with (the relaunch's overrides used to be written over it)."""
    run = files["root"] / "shortened"
    assert main(["train", *_model(files["good"], str(run))]) == 0
    record = (run / "config.yaml").read_text()
    assert "train_steps: 2" in record, record
    capsys.readouterr()
    assert main(["train", *_model(files["good"], str(run)), "--train.train_steps", "1"]) == 0
    assert "already finished at step 2" in capsys.readouterr().out
    assert (run / "config.yaml").read_text() == record
