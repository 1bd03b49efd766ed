"""Preprocessing that fails or is stopped leaves no output: a tokenizer error, a full disk, a key
or record that cannot be written, SIGTERM while writing or as a file is put in place; the next
run removes a killed run's temporary.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.indexed import IndexedDatasetWriter
from data_pipeline.preprocess import preprocess
from megazero.cli import main
from tests.preprocess_inputs import make_inputs, refused


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return make_inputs(tmp_path_factory.mktemp("pre"))


class _FullDisk:
    """A shard file on a full disk: every write fails, and so does the flush that closing does (the
    file is closed all the same, as a buffered file is)."""

    def __init__(self, file, mode, **kwargs):
        self._f = open(file, mode, **kwargs)

    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self):
        self._f.close()
        raise OSError(errno.ENOSPC, "No space left on device")


def test_failed_run_leaves_no_output(env, tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = Path(env["jsonl"]).read_text()
    bad.write_text(good + json.dumps({"body": "no text key"}) + "\n")
    with pytest.raises(ValueError, match="no key 'text'"):
        preprocess([str(bad)], str(tmp_path / "out"), env["model"], workers=2, batch_size=4)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


@pytest.mark.parametrize("where", ["tokens", "index"])
def test_a_full_disk_is_one_line_and_leaves_no_temporary_files(env, tmp_path, capsys, monkeypatch, where):
    """A full disk, while the tokens or the index were written, was a traceback naming no file and left
    the temporary .bin (and .idx) behind, holding the space a second attempt needs; the keys listed
    after the one that failed left theirs too."""
    import data_pipeline.indexed as indexed

    if where == "tokens":
        monkeypatch.setattr(indexed, "open", _FullDisk, raising=False)
    else:
        def full(f, *args):
            f.write(b"MMIDIDX")
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(indexed, "write_index", full)
    records = tmp_path / "in.jsonl"
    records.write_text(json.dumps({"text": "alpha", "title": "beta"}) + "\n")
    assert main(["preprocess", "--input", str(records), "--tokenizer", env["model"], "--output-prefix",
                 str(tmp_path / "out"), "--json-keys", "text", "title"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"megazero preprocess: error: {tmp_path / 'out'}_text_document: the shard cannot be written "
                   "(No space left on device); free space there or give another output prefix"), err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


@pytest.mark.parametrize("fails", ["index", "rename", "origin"])
def test_a_second_key_that_cannot_be_written_leaves_no_shard_of_the_first(env, tmp_path, capsys, monkeypatch, fails):
    """Of two ``--json-keys``, the second's ``.idx`` meets a full disk (or its files cannot be put in
    place): the first key's shard, already finished, stayed with its tokenizer record, and blocked the
    rerun as existing output; so did the folders made for the run. Now nothing is left, and the rerun
    writes both; so does a tokenizer record that cannot be written. (Planted: each key finished in
    turn, and an abort that removes temporary files only; the records removed after the writers'
    abort, whose folders they then kept.)"""
    import data_pipeline.indexed as indexed

    calls = []
    if fails == "index":
        real = indexed.write_index

        def flaky(f, *args):
            calls.append(f)
            if len(calls) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            real(f, *args)
        monkeypatch.setattr(indexed, "write_index", flaky)
    elif fails == "rename":  # a shard is put in place by a link (it never replaces: ``put_new``)
        real = os.link

        def flaky(src, dst):
            calls.append(dst)
            if len(calls) == 3:  # the second key's .bin, after the first key's two files
                raise OSError(errno.EIO, "Input/output error")
            real(src, dst)
        monkeypatch.setattr(os, "link", flaky)
    else:
        import data_pipeline.shard_origin as shard_origin

        real = shard_origin.file_sha256

        def flaky(path):  # the second key's record meets a full disk, the first key's is written
            if "out_title_document.idx" in str(path):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(path)
        monkeypatch.setattr(shard_origin, "file_sha256", flaky)
    records = tmp_path / "in.jsonl"
    records.write_text(json.dumps({"text": "alpha", "title": "beta"}) + "\n")
    argv = ["preprocess", "--input", str(records), "--tokenizer", env["model"], "--output-prefix",
            str(tmp_path / "new" / "deeper" / "out"), "--json-keys", "text", "title"]
    assert main(argv) == 2
    assert "out_title_document" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]
    monkeypatch.undo()
    assert main(argv) == 0
    assert sorted(p.name for p in (tmp_path / "new" / "deeper").iterdir()) == [
        f"out_{key}_document.{ext}" for key in ("text", "title") for ext in ("bin", "idx", "tokenizer.json")]


def test_a_run_that_fails_while_tokenizing_removes_the_folders_it_made(env, tmp_path, capsys):
    """A record that is not text, met after the shard writers made ``new/deeper/``, left those folders
    behind; a folder that was there before, or that holds another job's file, stays. (Planted: an
    abort that leaves the folders.)"""
    records = tmp_path / "in.jsonl"
    records.write_text(json.dumps({"text": "alpha"}) + "\n" + json.dumps({"text": 5}) + "\n")
    assert main(["preprocess", "--input", str(records), "--tokenizer", env["model"], "--output-prefix",
                 str(tmp_path / "new" / "deeper" / "out"), "--no-progress"]) == 2
    assert "in.jsonl:2" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]
    (tmp_path / "kept").mkdir()
    writer = IndexedDatasetWriter(str(tmp_path / "kept" / "shared" / "mine" / "out"), np.uint16)
    (tmp_path / "kept" / "shared" / "theirs.bin").write_bytes(b"x")  # another job writes beside it
    writer.abort()
    assert sorted(p.name for p in (tmp_path / "kept").rglob("*")) == ["shared", "theirs.bin"]


def _stopped_while_writing(env, tmp_path, signum):
    """``megazero preprocess`` on a large input in a process of its own, sent ``signum`` once it is
    writing its shard; returns the process, finished, and its stderr."""
    import subprocess
    import sys
    import time

    big = tmp_path / "big.jsonl"
    big.write_text(Path(env["jsonl"]).read_text() * 60)
    proc = subprocess.Popen([sys.executable, "-m", "megazero.cli", "preprocess", "--input", str(big), "--tokenizer",
                             env["model"], "--output-prefix", str(tmp_path / "out"), "--no-progress"],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("out_text_document.bin.tmp*")):  # tokenizing, and writing
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.02)
    proc.send_signal(signum)
    return proc, proc.communicate(timeout=60)[1]


def test_sigterm_mid_run_leaves_no_output(env, tmp_path):
    """What a scheduler sends at a time limit: the run stops as on Ctrl-C, in one line, and the shard
    it was writing under a temporary name is removed (SIGTERM's default left it behind)."""
    import signal

    proc, err = _stopped_while_writing(env, tmp_path, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip() == "megazero preprocess: stopped by SIGTERM", err
    assert sorted(os.listdir(tmp_path)) == ["big.jsonl"]


def test_a_killed_runs_temporary_is_removed_by_the_next_run(env, tmp_path):
    """SIGKILL (the OOM killer) runs no cleanup: the shard's temporary .bin stayed for ever beside the
    next run's output (planted: no sweep of temporaries no live writer holds)."""
    import signal

    proc, err = _stopped_while_writing(env, tmp_path, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL and list(tmp_path.glob("out_text_document.bin.tmp-*")), err
    assert main(["preprocess", "--input", env["jsonl"], "--tokenizer", env["model"], "--output-prefix",
                 str(tmp_path / "out"), "--no-progress"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["big.jsonl", *(f"out_text_document{ext}" for ext in (".bin", ".idx",
                                                                                                 ".tokenizer.json"))]


INTERRUPTED_AS_PUT_IN_PLACE = """
import os, signal, sys
from megazero.cli import main

call, suffix = sys.argv[1], sys.argv[2]
real = getattr(os, call)


def then_sigterm(src, dst, *args, **kwargs):  # the signal lands as the link or rename returns
    real(src, dst, *args, **kwargs)
    if str(dst).endswith(suffix):
        os.kill(os.getpid(), signal.SIGTERM)


setattr(os, call, then_sigterm)
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.parametrize("call, suffix", [("link", ".bin"), ("link", ".idx"), ("replace", ".tokenizer.json")])
def test_sigterm_as_a_file_is_put_in_place_leaves_nothing(env, tmp_path, call, suffix):
    """SIGTERM landing just as the .bin, the .idx or the tokenizer record reaches its final name: the
    run removes that file too, so it leaves no output and a re-run succeeds (planted: each counted as
    put in place only after the link or rename, so a .bin without its .idx, an .idx without its .bin
    or a record without its shard stayed behind, and the re-run was refused as existing)."""
    import signal
    import subprocess
    import sys

    argv = ["preprocess", "--input", env["jsonl"], "--tokenizer", env["model"], "--output-prefix",
            str(tmp_path / "out" / "o"), "--no-progress"]
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_AS_PUT_IN_PLACE, call, suffix, *argv],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert done.stderr.strip() == "megazero preprocess: stopped by SIGTERM", done.stderr
    assert os.listdir(tmp_path) == []
    assert main(argv) == 0


def test_a_merge_whose_tokenizer_record_fails_leaves_no_shard(env, tmp_path, capsys, monkeypatch):
    """The merged shard's record is written while its writer can still take the shard back: a record
    that cannot be written (a full disk) left the merged .bin/.idx in place unrecorded, so a run took
    them unchecked against its tokenizer, and a re-run was refused as existing."""
    import data_pipeline.shard_origin as shard_origin

    source = str(tmp_path / "src" / "s")
    assert main(["preprocess", "--input", env["jsonl"], "--tokenizer", env["model"], "--output-prefix", source,
                 "--no-progress"]) == 0

    def full_disk(prefix, identity, idx_file=None):
        raise OSError(f"{shard_origin.origin_path(prefix)}: the shard's tokenizer record cannot be written")
    monkeypatch.setattr(shard_origin, "write_origin", full_disk)
    refused(["preprocess", "--merge", f"{source}_text_document", "--output-prefix", str(tmp_path / "m")], capsys,
             "m.tokenizer.json: the shard's tokenizer record cannot be written")
    assert sorted(os.listdir(tmp_path)) == ["src"]
