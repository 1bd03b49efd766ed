"""Commands stopped as they put their outputs in place: killed outright (no clean-up of theirs runs),
or interrupted (their clean-up runs). What they leave is either complete and checked, or refused by
readers and named whole, in one line, by the rerun; and what they write is the same bytes each time.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from data_pipeline.tokenizer import train_sentencepiece
from megazero.cli import main

REPO = Path(__file__).resolve().parent.parent
LINES = [f"document {i}: the quick brown fox jumps over the lazy dog {i * 7}" for i in range(400)]

KILLED_AT = textwrap.dedent("""
    import os, sys
    from megazero.cli import main

    stop_at, calls = int(sys.argv[1]), [0]

    def killed_before(real):  # the process dies outright before its stop_at-th link or rename
        def call(*args, **kwargs):
            calls[0] += 1
            if calls[0] == stop_at:
                os._exit(9)
            return real(*args, **kwargs)
        return call

    os.link, os.replace = killed_before(os.link), killed_before(os.replace)
    sys.exit(main(sys.argv[2:]))
""")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in LINES))
    model = train_sentencepiece(iter(LINES), str(root / "tok"), 300, num_threads=1)
    return root, model


def _refused(argv, capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_preprocess_killed_putting_its_shard_in_place_never_leaves_it_without_its_record(inputs, tmp_path,
                                                                                         capsys):
    """Killed before each of its links and renames in turn: a shard whose .bin and .idx were in
    place without the tokenizer record was trained on unchecked against another tokenizer (a shard
    without a record is taken for one made elsewhere), and a rerun named its files one at a time.
    Now the record comes first and the .idx last; a partial shard is refused by its readers, and
    the rerun names all it left. (Planted: the record written after the shard is in place.)"""
    from data_pipeline.indexed import IndexedDataset
    from data_pipeline.shard_origin import read_origin

    root, model = inputs
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    states = []
    for stop_at in range(1, 12):
        out = tmp_path / f"killed{stop_at}" / "out"
        argv = ["preprocess", "--input", str(root / "docs.jsonl"), "--tokenizer", model, "--output-prefix", str(out),
                "--no-progress"]
        done = subprocess.run([sys.executable, "-c", KILLED_AT, str(stop_at), *argv], env=env, capture_output=True,
                              text=True, timeout=120)
        prefix = f"{out}_text_document"
        left = sorted(p.name for p in out.parent.iterdir() if ".tmp-" not in p.name)
        states.append(left)
        if done.returncode == 0:
            assert read_origin(prefix) is not None and len(IndexedDataset(prefix)) == 400
            break
        assert done.returncode == 9, done.stderr
        if "out_text_document.idx" in left:  # a shard: with its record, which was written for this .idx
            assert read_origin(prefix) is not None
        elif left:
            if "out_text_document.bin" in left:
                with pytest.raises(FileNotFoundError, match=r"out_text_document\.idx: no such file"):
                    IndexedDataset(prefix)
            err = _refused(argv, capsys)
            assert f"{', '.join(str(out.parent / name) for name in left)}: already exist" in err, err
            assert "without the shard's .idx" in err, err
    else:
        pytest.fail(f"the run never finished: {states}")
    assert ["out_text_document.tokenizer.json"] in states  # the record first, alone
    assert ["out_text_document.bin", "out_text_document.tokenizer.json"] in states  # the .idx last


def test_a_tokenizer_trains_to_the_same_bytes_and_is_put_in_place_whole(inputs, tmp_path, monkeypatch, capsys):
    """The model file kept the temporary name it was trained under (process id and random letters),
    so no two trainings on the same lines gave the same bytes, nor the tokenizer digests that shards
    and checkpoints record. Interrupted between its two files, a run removes the one it had put in
    place; a ``.vocab`` left alone by a kill is named as such. (Planted: the prefix not rewritten;
    the .model put in place first; the placed .vocab kept.)"""
    import data_pipeline.tokenizer as tokenizer

    lines = LINES
    digests = []
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        monkeypatch.chdir(tmp_path / run)
        model = train_sentencepiece(iter(lines), "tok/t", 300, num_threads=1)
        digests.append(Path(model).read_bytes())
    assert digests[0] == digests[1]

    real = os.replace

    def interrupted_at_the_model(src, dst):
        if str(dst).endswith(".model"):
            raise KeyboardInterrupt
        real(src, dst)
    monkeypatch.setattr(tokenizer.os, "replace", interrupted_at_the_model)
    with pytest.raises(KeyboardInterrupt):
        train_sentencepiece(iter(lines), "half/t", 300, num_threads=1)
    monkeypatch.undo()
    assert not (tmp_path / "b" / "half").exists()  # nothing, and not the folder made for it

    (tmp_path / "alone.vocab").write_text("")
    err = _refused(["tokenizer", "train", "--input", str(inputs[0] / "docs.jsonl"), "--model-prefix",
                    str(tmp_path / "alone"), "--vocab-size", "300"], capsys)
    assert "alone.vocab: exists without its .model" in err, err


def test_a_conversion_is_readable_by_others_and_an_interrupted_one_leaves_no_folders(tmp_path, capsys, monkeypatch):
    """The converted folder kept ``mkdtemp``'s owner-only permissions through its rename, so others
    on a shared cluster could not read a checkpoint converted for them; an interrupted conversion
    left the folders it had made above DST. (Planted: no chmod; the made folders kept.)"""
    import megazero.convert.streaming as streaming
    from megazero.convert.targets import write_megazero
    from tests.convert_sources import RandomSource

    write_megazero(RandomSource(num_layers=1), tmp_path / "mz")
    mask = os.umask(0o022)
    try:
        assert main(["convert", str(tmp_path / "mz"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    finally:
        os.umask(mask)
    assert stat.S_IMODE(os.stat(tmp_path / "hf").st_mode) == 0o755

    def interrupted(_):
        raise KeyboardInterrupt
    monkeypatch.setattr(streaming, "_make_durable", interrupted)
    assert main(["convert", str(tmp_path / "mz"), str(tmp_path / "new" / "deeper" / "hf"), "--to", "hf"]) == 130
    assert not (tmp_path / "new").exists()


def test_a_conversion_removes_the_staging_folders_of_conversions_killed_outright(tmp_path):
    """A conversion killed outright left its hidden staging folder, a whole checkpoint's size, and each
    retry under the same DST left another. The next conversion to that DST removes those whose lock
    it can take, and keeps one a live conversion holds. (Planted: no sweep; the lock not taken.)"""
    from data_pipeline import file_locks
    from megazero.convert.streaming import STAGING_LOCK
    from megazero.convert.targets import write_megazero
    from tests.convert_sources import RandomSource

    write_megazero(RandomSource(num_layers=1), tmp_path / "mz")
    killed, live = tmp_path / ".hf.killed.tmp", tmp_path / ".hf.live.tmp"
    for folder in (killed, live):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 1024)
        os.close(file_locks.create_locked(str(folder / STAGING_LOCK)))  # its writer gone: the lock with it
    held = file_locks.try_lock(str(live / STAGING_LOCK))  # a live conversion's
    try:
        assert main(["convert", str(tmp_path / "mz"), str(tmp_path / "hf"), "--to", "hf"]) == 0
        assert not killed.exists() and live.exists()
    finally:
        os.close(held)
    assert not (tmp_path / "hf" / STAGING_LOCK).exists()


def test_a_tokenizer_training_removes_what_trainings_killed_outright_left(tmp_path):
    """A training killed outright after SentencePiece wrote its files left them under their temporary
    names for good. The next training of the same prefix removes those whose lock it can take, and
    keeps a live training's. (Planted: no sweep.)"""
    from data_pipeline import file_locks

    killed, live = tmp_path / "t.tmp-1-aaaa", tmp_path / "t.tmp-2-bbbb"
    for stem in (killed, live):
        for ext in (".model", ".vocab"):
            Path(f"{stem}{ext}").write_bytes(b"x")
        os.close(file_locks.create_locked(f"{stem}.lock"))
    held = file_locks.try_lock(f"{live}.lock")
    try:
        train_sentencepiece(iter(LINES), str(tmp_path / "t"), 300, num_threads=1)
    finally:
        os.close(held)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.model", "t.tmp-2-bbbb.lock", "t.tmp-2-bbbb.model",
                                                          "t.tmp-2-bbbb.vocab", "t.vocab"]


def test_a_shard_writer_removes_a_killed_writers_record_temporary(tmp_path):
    """A preprocess killed while writing a shard's tokenizer record left the record's temporary for
    good. The next writer of the prefix removes it, unless a live writer (one holding its .bin
    temporary) may be writing it. (Planted: no sweep of records.)"""
    import numpy as np

    from data_pipeline.indexed import IndexedDatasetWriter

    prefix = str(tmp_path / "s")
    record_tmp = tmp_path / "s.tokenizer.json.tmp-1-aaaa"
    live = IndexedDatasetWriter(prefix, np.uint16)
    record_tmp.write_text("{")
    IndexedDatasetWriter(prefix, np.uint16).abort()  # the live writer's temporaries are locked
    assert record_tmp.exists()
    live.abort()
    IndexedDatasetWriter(prefix, np.uint16).abort()
    assert not record_tmp.exists()
