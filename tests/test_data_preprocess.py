"""Preprocessing: every input format gives the same shard, any worker count gives the same bytes,
each document is its tokens plus EOD, errors name the input, and the demo corpus is deterministic
(a run that fails or is stopped is in ``test_data_preprocess_failures.py``)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.demo_corpus import build_demo_corpus
from data_pipeline.indexed import IndexedDataset, IndexedDatasetWriter
from data_pipeline.preprocess import preprocess
from data_pipeline.tokenizer import load_tokenizer
from megazero.cli import main
from tests.preprocess_inputs import make_inputs, refused


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return make_inputs(tmp_path_factory.mktemp("pre"))


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
    refused(["preprocess", "--merge", f"{out}_text_document", f"{again}_text_document", "--output-prefix",
              str(tmp_path / "m2"), "--tokenizer", env["model"], "--workers", "0"], capsys,
             "--merge joins shards as they are, so --tokenizer, --workers would change nothing")
    refused(["preprocess", "--merge", f"{out}_text_document", f"{again}_text_document", "--output-prefix",
              str(tmp_path / "m2"), "--json-keys", "text", "--batch-size", "8", "--no-eod", "--skip-bad-records"],
             capsys, "so --json-keys, --batch-size, --no-eod, --skip-bad-records would change nothing")
    assert not list(tmp_path.glob("m2*"))


def test_cli_refuses_to_replace_an_existing_shard(env, tmp_path, capsys):
    """Preprocessing or merging onto a prefix already holding a shard would replace it without a word."""
    out = str(tmp_path / "kept")
    argv = ["preprocess", "--input", env["jsonl"], "--tokenizer", env["model"], "--output-prefix", out,
            "--no-progress"]
    assert main(argv) == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    refused(argv, capsys, f"{out}_text_document.bin: already exists",
             "give a new --output-prefix or remove it first")
    # every field's shard is looked for, not the first field's alone
    refused([*argv, "--json-keys", "path", "text"], capsys, f"{out}_text_document.bin: already exists")
    refused(["preprocess", "--merge", f"{out}_text_document", "--output-prefix", f"{out}_text_document"], capsys,
             f"--output-prefix {out}_text_document is one of the --merge shards")
    (tmp_path / "m.tokenizer.json").write_text("{}")  # a record alone is output too
    before["m.tokenizer.json"] = b"{}"
    refused(["preprocess", "--merge", f"{out}_text_document", "--output-prefix", str(tmp_path / "m")], capsys,
             "m.tokenizer.json: already exists")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    # a link whose target is gone still takes the name: found before tokenizing, not when publishing
    (tmp_path / "d_text_document.idx").symlink_to(tmp_path / "gone.idx")
    refused(["preprocess", "--input", env["jsonl"], "--tokenizer", env["model"], "--output-prefix",
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
    refused(["preprocess", "--input", env["jsonl"], "--tokenizer", env["model"], "--output-prefix", str(out),
              "--no-progress"], capsys, f"{shard}.bin: appeared while this run was writing it", "give a new output prefix")
    assert sorted(os.listdir(tmp_path)) == ["o_text_document.bin", "o_text_document.idx", "src"]
    assert list(IndexedDataset(shard).sizes) == [3]
    refused(["preprocess", "--merge", f"{source}_text_document", "--output-prefix", str(tmp_path / "m")], capsys,
             f"{tmp_path / 'm'}.bin: appeared while this run was writing it")
    assert sorted(os.listdir(tmp_path)) == ["m.bin", "m.idx", "o_text_document.bin", "o_text_document.idx", "src"]
    assert list(IndexedDataset(str(tmp_path / "m")).sizes) == [3]


def test_cli_refuses_an_input_listed_twice(env, tmp_path, capsys, monkeypatch):
    """The same file twice, however spelled or linked (symbolic or hard), would put every document in the
    shard twice. (Planted: paths resolved, the hard links passed.)"""
    monkeypatch.chdir(Path(env["jsonl"]).parent)
    name = os.path.basename(env["jsonl"])
    out = str(tmp_path / "o")
    refused(["preprocess", "--input", name, f"./{name}", "--tokenizer", env["model"], "--output-prefix", out,
              "--no-progress"], capsys, f"--input ./{name} is listed twice (also as {name})", "trained on twice")
    link = tmp_path / "link.jsonl"  # another name for the same file
    link.symlink_to(env["jsonl"])
    refused(["preprocess", "--input", name, str(link), "--tokenizer", env["model"], "--output-prefix", out,
              "--no-progress"], capsys, f"--input {link} is listed twice (also as {name})")
    link.unlink()
    os.link(env["jsonl"], link)  # a hard link: the same file under a name no path resolves to
    refused(["preprocess", "--input", name, str(link), "--tokenizer", env["model"], "--output-prefix", out,
              "--no-progress"], capsys, f"--input {link} is listed twice (also as {name})")
    link.unlink()
    assert main(["preprocess", "--input", name, "--tokenizer", env["model"], "--output-prefix", out,
                 "--no-progress"]) == 0
    shard = f"{out}_text_document"
    refused(["preprocess", "--merge", shard, shard, "--output-prefix", str(tmp_path / "m")], capsys,
             f"--merge {shard} is listed twice;")
    hard = tmp_path / "hard" / "o_text_document"
    hard.parent.mkdir()
    for ext in (".bin", ".idx", ".tokenizer.json"):
        os.link(f"{shard}{ext}", f"{hard}{ext}")
    refused(["preprocess", "--merge", shard, str(hard), "--output-prefix", str(tmp_path / "m")], capsys,
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
    refused([*argv, str(folder)], capsys, f"input file {folder / 'b.jsonl'} is listed twice (also as "
             f"{folder / 'a.jsonl'}), one file under two names; its documents would be trained on twice")
    (folder / "b.jsonl").unlink()
    (folder / "b.jsonl").symlink_to(folder / "a.jsonl")
    refused([*argv, str(folder)], capsys, "b.jsonl is listed twice")
    (folder / "b.jsonl").unlink()
    refused([*argv, env["jsonl"], str(folder)], capsys, f"input file {folder / 'a.jsonl'} is listed twice")
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
    refused(["preprocess", "--input", str(half), "--json-keys", "text", "--json-keys", "text", "--tokenizer",
              env["model"], "--output-prefix", str(tmp_path / "k"), "--no-progress"], capsys,
             "--json-keys text text: a field is listed twice")


def test_a_folder_of_text_files_is_refused(env, tmp_path, capsys):
    """``datasets`` reads a folder of .txt files one line per document (blank lines too): the documents'
    boundaries would be lost, so such a folder is refused, naming what megazero reads."""
    folder = tmp_path / "txt"
    folder.mkdir()
    (folder / "a.txt").write_text("one document\nover two lines\n\nand another\n")
    refused(["preprocess", "--input", str(folder), "--tokenizer", env["model"], "--output-prefix",
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
    refused(["preprocess", "--input", str(tmp_path / "dict"), "--hf-split", "validation", *common,
              str(tmp_path / "a")], capsys, "no split 'validation' (its splits: train)")
    refused(["preprocess", "--input", str(tmp_path / "one"), "--hf-split", "validation", *common,
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
