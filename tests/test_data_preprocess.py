"""Preprocessing: every input format gives the same shard, any worker count gives the same bytes,
each document is its tokens plus EOD, errors name the input, a failed run leaves no output, and
the demo corpus is deterministic."""

from __future__ import annotations

import errno
import gzip
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.demo_corpus import build_demo_corpus, write_stdlib_jsonl
from data_pipeline.indexed import IndexedDataset, IndexedDatasetWriter
from data_pipeline.preprocess import preprocess
from data_pipeline.tokenizer import load_tokenizer, read_texts, train_sentencepiece
from megazero.cli import main


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("pre")
    jsonl = str(root / "docs.jsonl")
    write_stdlib_jsonl(jsonl, max_bytes=200_000)
    with open(jsonl) as f:
        records = [json.loads(line) for line in f]
    model = train_sentencepiece(read_texts([jsonl]), str(root / "tok"), 500, max_sentences=30_000)
    return {"root": root, "jsonl": jsonl, "records": records, "model": model}


def shard_bytes(prefix):
    return tuple(Path(prefix + ext).read_bytes() for ext in (".bin", ".idx"))


def test_documents_are_tokens_plus_eod(env, tmp_path):
    preprocess([env["jsonl"]], str(tmp_path / "out"), env["model"], batch_size=7)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    tok = load_tokenizer(env["model"])
    assert ds.dtype == np.uint16 and len(ds) == len(env["records"])
    for i, record in enumerate(env["records"]):
        assert ds[i].tolist() == tok.encode(record["text"]) + [tok.eod_id]
        assert tok.decode(ds[i][:-1].tolist()) == record["text"]


def test_worker_count_does_not_change_the_bytes(env, tmp_path):
    one = preprocess([env["jsonl"]], str(tmp_path / "one"), env["model"], workers=1, batch_size=5)
    two = preprocess([env["jsonl"]], str(tmp_path / "two"), env["model"], workers=2, batch_size=5)
    assert shard_bytes(str(tmp_path / "one_text_document")) == shard_bytes(str(tmp_path / "two_text_document"))
    assert (one.documents, one.tokens, one.text_bytes) == (two.documents, two.tokens, two.text_bytes)
    assert one.text_bytes == sum(len(r["text"].encode()) for r in env["records"])


def write_formats(records, directory):
    """The same records as .jsonl.gz, .jsonl.zst, .parquet, a Hugging Face save_to_disk folder and a
folder of jsonl files for datasets.load_dataset."""
    lines = "".join(json.dumps(r) + "\n" for r in records).encode()
    paths = {"gz": f"{directory}/d.jsonl.gz"}
    with gzip.open(paths["gz"], "wb") as f:
        f.write(lines)
    try:
        import zstandard

        paths["zst"] = f"{directory}/d.jsonl.zst"
        with open(paths["zst"], "wb") as f:
            f.write(zstandard.ZstdCompressor().compress(lines))
    except ImportError:
        pass
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(records)
    paths["parquet"] = f"{directory}/d.parquet"
    pq.write_table(table, paths["parquet"], row_group_size=9)
    import datasets

    paths["hf"] = f"{directory}/hf"
    datasets.Dataset(table).save_to_disk(paths["hf"])
    paths["hf_data_dir"] = f"{directory}/hf_data_dir"  # a folder of data files: load_dataset, offline
    os.makedirs(paths["hf_data_dir"])
    with open(f"{paths['hf_data_dir']}/part-0.jsonl", "wb") as f:
        f.write(lines)
    return paths


def test_every_input_format_gives_the_same_shard(env, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    preprocess([env["jsonl"]], str(tmp_path / "ref"), env["model"])
    expected = shard_bytes(str(tmp_path / "ref_text_document"))
    paths = write_formats(env["records"], tmp_path)
    assert "zst" in paths, "zstandard is needed to test .zst input"
    for name, path in paths.items():
        preprocess([path], str(tmp_path / name), env["model"], batch_size=16)
        assert shard_bytes(str(tmp_path / f"{name}_text_document")) == expected, name


def test_several_keys_and_no_eod(env, tmp_path):
    preprocess([env["jsonl"]], str(tmp_path / "o"), env["model"], keys=("text", "path"), append_eod=False)
    tok = load_tokenizer(env["model"])
    paths = IndexedDataset(str(tmp_path / "o_path_document"))
    texts = IndexedDataset(str(tmp_path / "o_text_document"))
    assert paths[3].tolist() == tok.encode(env["records"][3]["path"])
    assert texts[3].tolist() == tok.encode(env["records"][3]["text"])
    # the command's flag too (planted: --no-eod parsed but EOD appended all the same)
    assert main(["preprocess", "--input", env["jsonl"], "--tokenizer", env["model"], "--json-keys", "path",
                 "--no-eod", "--output-prefix", str(tmp_path / "cli"), "--no-progress"]) == 0
    cli = IndexedDataset(str(tmp_path / "cli_path_document"))
    assert [cli[i].tolist() for i in range(len(cli))] == [paths[i].tolist() for i in range(len(paths))]


def test_large_hf_vocabulary_writes_int32(env, tmp_path):
    """A tokenizer.json of 70k words: token ids above uint16 need (and get) an int32 shard."""
    tokenizers = pytest.importorskip("tokenizers")
    words = [f"w{i}" for i in range(70_000)]
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"w0 w{n} w69999 nope"}) + "\n" for n in (5, 65600)))
    preprocess([str(docs)], str(tmp_path / "big"), str(tmp_path / "tokenizer.json"), workers=2)
    ds = IndexedDataset(str(tmp_path / "big_text_document"))
    assert ds.dtype == np.int32
    assert [ds[i].tolist() for i in range(2)] == [[2, 7, 70001, 1, 0], [2, 65602, 70001, 1, 0]]


def test_failed_run_leaves_no_output(env, tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = Path(env["jsonl"]).read_text()
    bad.write_text(good + json.dumps({"body": "no text key"}) + "\n")
    with pytest.raises(ValueError, match="no key 'text'"):
        preprocess([str(bad)], str(tmp_path / "out"), env["model"], workers=2, batch_size=4)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


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
    _refused(["preprocess", "--merge", f"{source}_text_document", "--output-prefix", str(tmp_path / "m")], capsys,
             "m.tokenizer.json: the shard's tokenizer record cannot be written")
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_empty_input_is_refused(env, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no documents in"):
        preprocess([str(empty)], str(tmp_path / "out"), env["model"])
    assert sorted(os.listdir(tmp_path)) == ["empty.jsonl"]


def test_cli_preprocess_and_merge(env, tmp_path, capsys):
    out = str(tmp_path / "cli")
    argv = ["preprocess", "--input", env["jsonl"], "--tokenizer", env["model"], "--output-prefix", out,
            "--workers", "2", "--no-progress"]
    assert main(argv) == 0
    report = capsys.readouterr().out
    assert "docs/s" in report and "MB/s" in report and f"{len(env['records'])} documents" in report
    again = str(tmp_path / "again")
    assert main(["preprocess", "--input", env["jsonl"], "--tokenizer", env["model"], "--output-prefix", again,
                 "--no-progress"]) == 0
    assert main(["preprocess", "--merge", f"{out}_text_document", f"{again}_text_document",
                 "--output-prefix", str(tmp_path / "merged")]) == 0
    merged = IndexedDataset(str(tmp_path / "merged"))
    assert len(merged) == 2 * len(env["records"])
    assert merged[len(env["records"])].tolist() == merged[0].tolist()
    # a merge re-tokenizes nothing: a tokenizer, keys or workers given with it would be ignored
    _refused(["preprocess", "--merge", f"{out}_text_document", f"{again}_text_document", "--output-prefix",
              str(tmp_path / "m2"), "--tokenizer", env["model"], "--workers", "0"], capsys,
             "--merge joins shards as they are, so --tokenizer, --workers would change nothing")
    _refused(["preprocess", "--merge", f"{out}_text_document", f"{again}_text_document", "--output-prefix",
              str(tmp_path / "m2"), "--json-keys", "text", "--batch-size", "8", "--no-eod", "--skip-bad-records"],
             capsys, "so --json-keys, --batch-size, --no-eod, --skip-bad-records would change nothing")
    assert not list(tmp_path.glob("m2*"))


def _refused(argv, capsys, *words):
    """The CLI refused ``argv`` with status 2 and one line naming ``words``, no traceback."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert all(w in err for w in words), err


def test_cli_refuses_to_replace_an_existing_shard(env, tmp_path, capsys):
    """Preprocessing or merging onto a prefix already holding a shard would replace it without a word."""
    out = str(tmp_path / "kept")
    argv = ["preprocess", "--input", env["jsonl"], "--tokenizer", env["model"], "--output-prefix", out,
            "--no-progress"]
    assert main(argv) == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    _refused(argv, capsys, f"{out}_text_document.bin: already exists",
             "give a new --output-prefix or remove it first")
    # every field's shard is looked for, not the first field's alone
    _refused([*argv, "--json-keys", "path", "text"], capsys, f"{out}_text_document.bin: already exists")
    _refused(["preprocess", "--merge", f"{out}_text_document", "--output-prefix", f"{out}_text_document"], capsys,
             f"--output-prefix {out}_text_document is one of the --merge shards")
    (tmp_path / "m.tokenizer.json").write_text("{}")  # a record alone is output too
    before["m.tokenizer.json"] = b"{}"
    _refused(["preprocess", "--merge", f"{out}_text_document", "--output-prefix", str(tmp_path / "m")], capsys,
             "m.tokenizer.json: already exists")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    # a link whose target is gone still takes the name: found before tokenizing, not when publishing
    (tmp_path / "d_text_document.idx").symlink_to(tmp_path / "gone.idx")
    _refused(["preprocess", "--input", env["jsonl"], "--tokenizer", env["model"], "--output-prefix",
              str(tmp_path / "d"), "--no-progress"], capsys, "d_text_document.idx: already exists")


def test_a_shard_written_by_another_run_meanwhile_is_kept(env, tmp_path, capsys, monkeypatch):
    """Two runs started at once on one prefix both pass the check for existing output; the one that
    finishes second used to replace the first's shard. Now it stops in one line naming the file, and
    leaves the other run's shard as it was and none of its own files (no tokenizer record either);
    so does a merge. (Planted: publishing by rename.)"""
    import data_pipeline.indexed as indexed

    out = tmp_path / "o"
    shard = f"{out}_text_document"
    source = str(tmp_path / "src" / "s")  # a shard to merge, not the other run's
    assert main(["preprocess", "--input", env["jsonl"], "--tokenizer", env["model"], "--output-prefix", source,
                 "--no-progress"]) == 0
    real_seal = indexed.IndexedDatasetWriter.seal

    def other_run_finishes_first(self):  # while this run seals, the other one finishes its shard
        real_seal(self)
        if self.replace is False:  # this run's writer, not the other's
            with IndexedDatasetWriter(self.prefix, np.uint16) as other:
                other.add_document([7, 7, 7])
    monkeypatch.setattr(indexed.IndexedDatasetWriter, "seal", other_run_finishes_first)
    _refused(["preprocess", "--input", env["jsonl"], "--tokenizer", env["model"], "--output-prefix", str(out),
              "--no-progress"], capsys, f"{shard}.bin: appeared while this run was writing it", "give a new output prefix")
    assert sorted(os.listdir(tmp_path)) == ["o_text_document.bin", "o_text_document.idx", "src"]
    assert list(IndexedDataset(shard).sizes) == [3]
    _refused(["preprocess", "--merge", f"{source}_text_document", "--output-prefix", str(tmp_path / "m")], capsys,
             f"{tmp_path / 'm'}.bin: appeared while this run was writing it")
    assert sorted(os.listdir(tmp_path)) == ["m.bin", "m.idx", "o_text_document.bin", "o_text_document.idx", "src"]
    assert list(IndexedDataset(str(tmp_path / "m")).sizes) == [3]


def test_cli_refuses_an_input_listed_twice(env, tmp_path, capsys, monkeypatch):
    """The same file twice, however spelled or linked (symbolic or hard), would put every document in the
    shard twice. (Planted: paths resolved, the hard links passed.)"""
    monkeypatch.chdir(Path(env["jsonl"]).parent)
    name = os.path.basename(env["jsonl"])
    out = str(tmp_path / "o")
    _refused(["preprocess", "--input", name, f"./{name}", "--tokenizer", env["model"], "--output-prefix", out,
              "--no-progress"], capsys, f"--input ./{name} is listed twice (also as {name})", "trained on twice")
    link = tmp_path / "link.jsonl"  # another name for the same file
    link.symlink_to(env["jsonl"])
    _refused(["preprocess", "--input", name, str(link), "--tokenizer", env["model"], "--output-prefix", out,
              "--no-progress"], capsys, f"--input {link} is listed twice (also as {name})")
    link.unlink()
    os.link(env["jsonl"], link)  # a hard link: the same file under a name no path resolves to
    _refused(["preprocess", "--input", name, str(link), "--tokenizer", env["model"], "--output-prefix", out,
              "--no-progress"], capsys, f"--input {link} is listed twice (also as {name})")
    link.unlink()
    assert main(["preprocess", "--input", name, "--tokenizer", env["model"], "--output-prefix", out,
                 "--no-progress"]) == 0
    shard = f"{out}_text_document"
    _refused(["preprocess", "--merge", shard, shard, "--output-prefix", str(tmp_path / "m")], capsys,
             f"--merge {shard} is listed twice;")
    hard = tmp_path / "hard" / "o_text_document"
    hard.parent.mkdir()
    for ext in (".bin", ".idx", ".tokenizer.json"):
        os.link(f"{shard}{ext}", f"{hard}{ext}")
    _refused(["preprocess", "--merge", shard, str(hard), "--output-prefix", str(tmp_path / "m")], capsys,
             f"--merge {hard} is listed twice (also as {shard});")
    shutil.rmtree(hard.parent)
    written = [f"o_text_document{ext}" for ext in (".bin", ".idx", ".tokenizer.json")]
    assert sorted(p.name for p in tmp_path.iterdir()) == written  # the refused merge wrote nothing


def test_one_file_under_two_names_in_a_folder_is_read_once_or_refused(env, tmp_path, capsys):
    """A folder holding two links to one file (hard, or a symbolic link beside its target), or a file
    listed beside a folder holding a hard link to it, would read its documents twice though no name
    is listed twice: refused in one line, before any shard is written. (Planted: no check of the
    folders' files.)"""
    folder = tmp_path / "in"
    folder.mkdir()
    os.link(env["jsonl"], folder / "a.jsonl")
    os.link(env["jsonl"], folder / "b.jsonl")
    out = str(tmp_path / "o")
    argv = ["preprocess", "--tokenizer", env["model"], "--output-prefix", out, "--no-progress", "--input"]
    _refused([*argv, str(folder)], capsys, f"input file {folder / 'b.jsonl'} is listed twice (also as "
             f"{folder / 'a.jsonl'}), one file under two names; its documents would be trained on twice")
    (folder / "b.jsonl").unlink()
    (folder / "b.jsonl").symlink_to(folder / "a.jsonl")
    _refused([*argv, str(folder)], capsys, "b.jsonl is listed twice")
    (folder / "b.jsonl").unlink()
    _refused([*argv, env["jsonl"], str(folder)], capsys, f"input file {folder / 'a.jsonl'} is listed twice")
    assert not list(tmp_path.glob("o*"))  # nothing written
    assert main([*argv, str(folder)]) == 0


def test_repeated_input_and_merge_flags_add_up(env, tmp_path, capsys):
    """``--input A --input B`` reads both (argparse alone would keep only B, dropping A's documents);
    so does ``--merge``; a field listed twice in ``--json-keys`` is refused."""
    half = tmp_path / "half.jsonl"
    half.write_text("".join(json.dumps(r) + "\n" for r in env["records"][:7]))
    out = str(tmp_path / "both")
    assert main(["preprocess", "--input", env["jsonl"], "--input", str(half), "--tokenizer", env["model"],
                 "--output-prefix", out, "--no-progress"]) == 0
    assert len(IndexedDataset(f"{out}_text_document")) == len(env["records"]) + 7
    assert main(["preprocess", "--input", str(half), "--tokenizer", env["model"], "--output-prefix",
                 str(tmp_path / "h"), "--no-progress"]) == 0
    assert main(["preprocess", "--merge", f"{out}_text_document", "--merge", str(tmp_path / "h_text_document"),
                 "--output-prefix", str(tmp_path / "m")]) == 0
    assert len(IndexedDataset(str(tmp_path / "m"))) == len(env["records"]) + 14
    _refused(["preprocess", "--input", str(half), "--json-keys", "text", "--json-keys", "text", "--tokenizer",
              env["model"], "--output-prefix", str(tmp_path / "k"), "--no-progress"], capsys,
             "--json-keys text text: a field is listed twice")


def test_a_folder_of_text_files_is_refused(env, tmp_path, capsys):
    """``datasets`` reads a folder of .txt files one line per document (blank lines too): the documents'
    boundaries would be lost, so such a folder is refused, naming what megazero reads."""
    folder = tmp_path / "txt"
    folder.mkdir()
    (folder / "a.txt").write_text("one document\nover two lines\n\nand another\n")
    _refused(["preprocess", "--input", str(folder), "--tokenizer", env["model"], "--output-prefix",
              str(tmp_path / "t"), "--no-progress"], capsys, f"{folder}: a folder of .txt files", "one line per document")


def test_an_unreachable_hub_name_is_one_line(env, tmp_path, capfd, monkeypatch):
    """Offline, the hub client warns at every retry of a name it cannot reach (ten lines before the
    error); the run reports the error alone, in one line. Where the warnings land depends on the
    handler the hub's logger was first given (an earlier test's stream, in a whole-file run), so the
    levels are checked too: warnings held back while the dataset is looked up, and the levels the
    user set back afterwards."""
    import logging

    datasets = pytest.importorskip("datasets")
    from huggingface_hub.utils import logging as hub_logging

    before = [logging.getLogger(name).level for name in ("huggingface_hub", "datasets")]
    warned = []

    def unreachable(path, **kwargs):
        warned.append(hub_logging.get_logger("huggingface_hub.utils._http").isEnabledFor(logging.WARNING))
        for attempt in range(1, 6):
            hub_logging.get_logger("huggingface_hub.utils._http").warning(f"Retrying in 1s [Retry {attempt}/5].")
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    capfd.readouterr()
    assert main(["preprocess", "--input", "no-user/no-dataset", "--tokenizer", env["model"], "--no-progress",
                 "--output-prefix", str(tmp_path / "hub")]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "Couldn't reach 'no-user/no-dataset' on the Hub" in err, err
    assert warned == [False]
    assert [logging.getLogger(name).level for name in ("huggingface_hub", "datasets")] == before


def test_hf_split_is_checked_against_the_saved_dataset(env, tmp_path, capsys):
    """A saved DatasetDict without the split asked for names its splits; a saved single Dataset has no
    split to choose, so ``--hf-split`` there is refused rather than ignored."""
    datasets = pytest.importorskip("datasets")
    records = [{"text": r["text"]} for r in env["records"][:5]]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(tmp_path / "dict")
    datasets.Dataset.from_list(records).save_to_disk(tmp_path / "one")
    common = ["--tokenizer", env["model"], "--no-progress", "--output-prefix"]
    _refused(["preprocess", "--input", str(tmp_path / "dict"), "--hf-split", "validation", *common,
              str(tmp_path / "a")], capsys, "no split 'validation' (its splits: train)")
    _refused(["preprocess", "--input", str(tmp_path / "one"), "--hf-split", "validation", *common,
              str(tmp_path / "b")], capsys, "a saved dataset of one split", "leave --hf-split out")
    assert main(["preprocess", "--input", str(tmp_path / "dict"), *common, str(tmp_path / "c")]) == 0
    assert main(["preprocess", "--input", str(tmp_path / "one"), *common, str(tmp_path / "d")]) == 0
    assert len(IndexedDataset(str(tmp_path / "c_text_document"))) == 5 == len(IndexedDataset(str(tmp_path / "d_text_document")))


@pytest.mark.parametrize("argv_tail,message", [
    (["--input", "missing.jsonl"], "missing.jsonl: no such input file"),
    (["--input", "{jsonl}", "--json-keys", "body"], "no key 'body'"),
    (["--input", "{model}"], "unknown input type"),
])
def test_cli_errors_name_the_problem(env, tmp_path, capsys, argv_tail, message):
    argv_tail = [a.format(**env) for a in argv_tail]
    rc = main(["preprocess", "--tokenizer", env["model"], "--output-prefix", str(tmp_path / "x"), "--no-progress",
               *argv_tail])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_cli_tokenizer_train_and_encode(env, tmp_path, capsys):
    prefix = str(tmp_path / "cli_tok")
    assert main(["tokenizer", "train", "--input", env["jsonl"], "--model-prefix", prefix, "--vocab-size", "400",
                 "--max-sentences", "20000"]) == 0
    capsys.readouterr()
    assert main(["tokenizer", "encode", "--tokenizer", prefix + ".model", "import os"]) == 0
    ids = [int(x) for x in capsys.readouterr().out.split()]
    assert load_tokenizer(prefix + ".model").decode(ids) == "import os"


def test_demo_corpus_is_deterministic(tmp_path):
    a = build_demo_corpus(str(tmp_path / "a"), max_bytes=150_000, vocab_size=400)
    b = build_demo_corpus(str(tmp_path / "b"), max_bytes=150_000, vocab_size=400)
    assert Path(a["jsonl"]).read_bytes() == Path(b["jsonl"]).read_bytes()
    assert 100_000 < a["bytes"] <= 150_000 and a["documents"] > 5
    assert shard_bytes(a["data_prefix"]) == shard_bytes(b["data_prefix"])
    paths = [json.loads(line)["path"] for line in Path(a["jsonl"]).read_text().splitlines()]
    assert len({p.split("/")[0] for p in paths}) > 3  # spread over the stdlib, not one package


def test_a_failed_demo_build_leaves_no_folder(tmp_path):
    """A vocabulary the collected text cannot fill fails in training, after the folder was made."""
    with pytest.raises(ValueError, match="more than this text can fill"):
        build_demo_corpus(str(tmp_path / "new" / "demo"), max_bytes=20_000, vocab_size=100_000)
    assert list(tmp_path.iterdir()) == []


def test_a_refused_preprocess_creates_no_folder(tmp_path, capsys):
    """``--workers 0`` was refused after the output prefix's folders had been made, and a missing tokenizer after
    they had been made to check that they could be."""
    from megazero.cli import main

    fresh = tmp_path / "fresh"
    assert main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--tokenizer", str(tmp_path / "tok.json"),
                 "--output-prefix", str(fresh / "sub" / "w0"), "--workers", "0"]) == 2
    assert "--workers: 0 must be at least 1" in capsys.readouterr().err and not fresh.exists()
    assert main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--tokenizer", str(tmp_path / "tok.json"),
                 "--output-prefix", str(fresh / "w0"), "--batch-size", "-3"]) == 2
    assert "--batch-size: -3 must be at least 1" in capsys.readouterr().err and not fresh.exists()
    # refused after the output folder was checked: a missing tokenizer left the folders made for the check
    assert main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--tokenizer", str(tmp_path / "tok.json"),
                 "--output-prefix", str(fresh / "sub" / "w0")]) == 2
    assert "tok.json: tokenizer file not found" in capsys.readouterr().err and not fresh.exists()
