"""Folders as preprocessing inputs: a folder is read as the files it held when the run began, so
shards written into it cannot change how it is read; an input inside a folder also given, or
shards written into an input folder, are refused before anything is read."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_pipeline.indexed import IndexedDataset
from data_pipeline.paths import inside_another, output_inside
from data_pipeline.preprocess import preprocess
from data_pipeline.tokenizer import train_sentencepiece
from tests.preprocess_inputs import refused

TEXTS = [f"document number {i} with a few words about folders and shards" for i in range(40)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("folder_tok")
    return train_sentencepiece(iter(TEXTS * 3), str(root / "sp"), 300, max_sentences=1000)


def _folder(root):
    """A folder of two kinds of file that are read file by file: 5 jsonl and 7 parquet documents."""
    root.mkdir()
    (root / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:5]))
    pq.write_table(pa.table({"text": TEXTS[5:12]}), str(root / "c.parquet"))
    return root


def test_a_folder_is_read_as_the_files_it_held_before_any_shard_was_begun(model, tmp_path):
    """The shard's temporary files appear before the first document is read; a folder listed after
    that was no folder of .jsonl/.parquet files any more, went to the datasets reader, and lost its
    jsonl file's documents without a word. (Planted: the folder listed as it is read: 7 documents.)"""
    folder = _folder(tmp_path / "in")
    stats = preprocess([str(folder)], str(folder / "web"), model)
    assert stats.documents == 12
    assert len(IndexedDataset(str(folder / "web_text_document"))) == 12


def test_cli_refuses_an_input_inside_another_and_shards_inside_an_input(model, tmp_path, capsys):
    """A file beside the folder holding it, or a folder beside its subfolder, would be read twice; shards
    written into an input folder (or below it) make it unreadable as input next time. Each is refused
    in one line before anything is written. (Planted: either check left out; the run then exits 0.)"""
    folder = _folder(tmp_path / "in")
    sub = folder / "sub"
    sub.mkdir()
    (sub / "b.jsonl").write_text(json.dumps({"text": TEXTS[20]}) + "\n")
    common = ["--tokenizer", model, "--no-progress", "--output-prefix"]
    refused(["preprocess", "--input", str(folder), str(folder / "a.jsonl"), *common, str(tmp_path / "o")], capsys,
             f"--input {folder / 'a.jsonl'} lies inside --input {folder}, which reads it already", "trained on twice")
    refused(["preprocess", "--input", str(sub), str(folder), *common, str(tmp_path / "o")], capsys,
             f"--input {sub} lies inside --input {folder}")
    for prefix in (folder / "web", folder / "shards" / "web"):
        refused(["preprocess", "--input", str(folder), *common, str(prefix)], capsys,
                 f"--output-prefix {prefix}: inside the input folder {folder}", "write them outside it")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]
    assert sorted(p.name for p in folder.iterdir()) == ["a.jsonl", "c.parquet", "sub"]


def test_nesting_is_judged_on_real_paths(tmp_path):
    """Spellings and links are followed; a sibling whose name starts with the folder's is not inside
    it; a hub name, which is no local path, is inside nothing."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("{}\n")
    (tmp_path / "in2").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "in")
    assert inside_another([("--input", str(tmp_path / "in2")), ("--input", str(tmp_path / "in"))]) is None
    assert inside_another([("--input", "."), ("--input", "org/dataset")]) is None
    found = inside_another([("--input", str(tmp_path / "link" / "a.jsonl")), ("--input", f"{tmp_path}/./in/")])
    assert found == (f"--input {tmp_path / 'link' / 'a.jsonl'} lies inside --input {tmp_path}/./in/, which reads it "
                     "already")
    assert output_inside(str(tmp_path / "in2" / "web"), [str(tmp_path / "in")]) is None
    assert output_inside(str(tmp_path / "link" / "new" / "web"), [str(tmp_path / "in")]) == str(tmp_path / "in")
