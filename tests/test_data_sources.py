"""Inputs: a missing file is named as missing, a zstd file may open with any skippable frame, and a
folder is read as the files it holds, in name order (which fixes the order of the shard's documents)."""

from __future__ import annotations

import json

import pytest

from data_pipeline.sources import (check_compression, check_input, input_files, iter_batches, iter_lines,
                                   plain_data_files, reads_as_dataset)


def write_jsonl(path, texts):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def test_a_folders_files_are_read_in_name_order(tmp_path):
    """The documents of a folder come file by file in name order, whatever order the file system
    lists them in, so a shard made from it is reproducible; a README and hidden files are not data and
    do not stop the folder being read so. (Planted: the listing left unsorted; hidden files counted.)"""
    names = ["07.jsonl", "02.jsonl", "sub/01.jsonl", "05.jsonl", "11.jsonl", "00.jsonl", "09.jsonl", "03.jsonl"]
    for name in names:
        write_jsonl(tmp_path / name, [f"{name} first", f"{name} second"])
    (tmp_path / "README.md").write_text("about these files\n")
    (tmp_path / ".hidden").write_text("not data\n")
    ordered = sorted(names, key=lambda name: str(tmp_path / name))
    assert plain_data_files(str(tmp_path)) == [str(tmp_path / name) for name in ordered]
    assert input_files(str(tmp_path)) == plain_data_files(str(tmp_path))
    texts = [json.loads(line)["text"] for name in input_files(str(tmp_path))
             for batch in iter_batches(name, ("text",), batch_size=3) for line in batch.lines]
    assert texts == [f"{name} {which}" for name in ordered for which in ("first", "second")]


def test_a_folder_with_a_file_of_another_kind_is_not_read_as_plain_files(tmp_path):
    """Read file by file, a folder holding something besides jsonl and parquet (a README and hidden
    files aside) would lose that file's documents without a word; it is left to the datasets reader's
    checks, which refuse it (below). (Planted: the other file dropped and the rest read.)"""
    write_jsonl(tmp_path / "a.jsonl", ["alpha"])
    (tmp_path / "b.csv").write_text("text\nbeta\n")
    assert plain_data_files(str(tmp_path)) is None and reads_as_dataset(str(tmp_path))


def test_a_folder_of_jsonl_and_parquet_files_is_read_file_by_file(tmp_path):
    """Both kinds are read by megazero's own readers, file by file, so a folder of the two is no mix
    for the datasets reader to half read (planted: any two kinds refused)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "a.jsonl", ["alpha"])
    pq.write_table(pa.table({"text": ["beta"]}), tmp_path / "b.parquet")
    check_input(str(tmp_path), ("text",))
    assert plain_data_files(str(tmp_path)) == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")]


def test_a_folder_of_text_files_in_capitals_is_refused_as_text_files(tmp_path):
    """The datasets reader takes a suffix in any case, so NOTES.TXT is read one line per document as a
    .txt file is (planted: suffixes compared as written)."""
    (tmp_path / "NOTES.TXT").write_text("a document\nof two lines\n")
    with pytest.raises(ValueError, match=r": a folder of \.txt files, which would be read one line per document"):
        check_input(str(tmp_path), ("text",))


@pytest.mark.parametrize("name", ["gone.jsonl", "gone.jsonl.zst", "gone.parquet"])
def test_a_missing_input_file_is_named_as_missing(tmp_path, name):
    """A file name that is not there is "no such input file", for parquet too (planted: a missing
    .parquet reported as a file whose footer cannot be read)."""
    with pytest.raises(FileNotFoundError, match=rf"{name}: no such input file"):
        check_input(str(tmp_path / name), ("text",))


@pytest.mark.parametrize("nibble", [0x0, 0x7, 0xF])
def test_a_zstd_file_may_open_with_any_skippable_frame(tmp_path, nibble):
    """zstd's skippable frames have 16 magic numbers, 0x184D2A50 to 0x184D2A5F (tools put metadata
    there); each opens a zstd file, and the lines after it are read. (Planted: only 0x184D2A50.)"""
    zstandard = pytest.importorskip("zstandard")
    path = tmp_path / "d.jsonl.zst"
    skippable = bytes([0x50 | nibble, 0x2A, 0x4D, 0x18]) + (3).to_bytes(4, "little") + b"abc"
    path.write_bytes(skippable + zstandard.ZstdCompressor().compress(b'{"text": "kept"}\n'))
    check_compression(str(path))
    assert [line for _, line in iter_lines(str(path))] == [b'{"text": "kept"}\n']


@pytest.mark.parametrize("text", ['[\n{"text": "a"},\n{"text": "b"}\n]\n', '\n  [{"text": "a"}, {"text": "b"}]\n'])
def test_a_json_array_is_refused_before_it_is_read(tmp_path, text):
    """A JSON array printed one element a line has one line that parses (the last, without its comma):
    under --skip-bad-records it was the file's one document, the others skipped, status 0. A file whose
    first record opens an array is refused up front. (Planted: no look at the first line.)"""
    path = tmp_path / "array.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"array\.json:\d: starts a JSON array, not JSON lines"):
        check_input(str(path), ("text",))


@pytest.mark.parametrize("name, refusal", [
    ("a.txt.gz", "a folder of .txt.gz files, which would be read one line per document"),
    ("a.jsonl.bz2", "a folder of .jsonl.bz2 files, which megazero reads only plain, .gz or .zst"),
    ("a.json.xz", "a folder of .json.xz files, which megazero reads only plain, .gz or .zst")])
def test_a_folder_of_files_compressed_otherwise_is_refused(tmp_path, name, refusal):
    """A folder of compressed files whose kind megazero does not read itself went to the datasets
    reader, the kind taken from the compression's suffix alone: .txt.gz files were read one line per
    document, and .jsonl.bz2 files as one table, a number in a text field becoming text; each is
    refused as its plain kind is. (Planted: the kind from the last suffix.)"""
    (tmp_path / name).write_bytes(b"not read")
    with pytest.raises(ValueError) as refused:
        check_input(str(tmp_path), ("text",))
    assert str(refused.value).startswith(f"{tmp_path}: {refusal}"), refused.value


@pytest.mark.parametrize("other, kind", [("notes.txt", ".txt"), ("b.csv", ".csv")])
def test_a_folder_of_mixed_kinds_is_refused_naming_them(tmp_path, other, kind):
    """The datasets reader takes one kind of file from a folder and leaves the rest out without a word
    (``a.jsonl`` beside ``b.csv`` came back as ``a.jsonl`` alone), so a folder of two kinds is refused
    before any input is read, naming each kind; one with a .txt file among jsonl files was called "a
    folder of .txt files". (Planted: the kinds not compared; a mix called a folder of .txt files.)"""
    write_jsonl(tmp_path / "a.jsonl", ["alpha"])
    (tmp_path / other).write_text("text\nbeta\n")
    with pytest.raises(ValueError) as refused:
        check_input(str(tmp_path), ("text",))
    assert str(refused.value) == (
        f"{tmp_path}: a folder of mixed kinds of file ({kind}: {other}; jsonl: a.jsonl), of which the datasets reader "
        "would read one kind and leave the others out; give a folder of .jsonl/.json(.gz/.zst) and .parquet files, or "
        "of one kind")
