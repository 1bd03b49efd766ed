"""Bad input never becomes a document: a field that is not a string, a malformed or non-UTF-8 json
line, a truncated compressed file. Each is an error naming the file and the record (jsonl line,
parquet row, dataset index), or with skip_bad_records a skip counted by reason."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.indexed import IndexedDataset
from data_pipeline.preprocess import preprocess
from data_pipeline.tokenizer import load_tokenizer
from megazero.cli import main

WORDS = ["alpha", "beta", "gamma", "delta"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A word-level tokenizer.json: built in milliseconds, and the ids are easy to read."""
    import tokenizers

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def jsonl(path, *lines: bytes | str | dict) -> str:
    """Write lines as given: a dict as json, bytes as they are (invalid ones included)."""
    raw = b"".join((json.dumps(x).encode() if isinstance(x, dict) else x.encode() if isinstance(x, str) else x)
                   + b"\n" for x in lines)
    Path(path).write_bytes(gzip.compress(raw) if str(path).endswith(".gz") else raw)
    return str(path)


NOT_TEXT = [  # (the "text" field of a record, or its absence; what the error says about it)
    ({"text": None}, "field 'text' is null, not a string"),
    ({"text": 7}, "field 'text' is a number, not a string"),
    ({"text": {"nested": 1}}, "field 'text' is an object, not a string"),
    ({"text": ["alpha"]}, "field 'text' is a list, not a string"),
    ({"body": "alpha"}, r"no key 'text' \(keys: \['body'\]\)"),
]


@pytest.mark.parametrize("record, message", NOT_TEXT, ids=["null", "number", "object", "list", "missing"])
def test_jsonl_field_that_is_not_text_is_an_error(tokenizer, tmp_path, record, message):
    path = jsonl(tmp_path / "d.jsonl", {"text": "alpha"}, "", record)
    with pytest.raises(ValueError, match=rf"d\.jsonl:3: {message}; .*--skip-bad-records"):
        preprocess([path], str(tmp_path / "out"), tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]


@pytest.mark.parametrize("line, message", [
    (b'{"text": "alpha"', "malformed JSON"),
    (b'{"text": "\xff\xfe"}', r"not UTF-8 \(byte 10 is b'\\xff'\)"),
    (b'["alpha"]', "a JSON list, not an object"),
    (b'{"text": "\\ud800"}', "field 'text' holds an unpaired surrogate"),
    (b'{"text": "alpha", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "malformed JSON .nested deeper"),
    (b'{"text": "alpha", "n": ' + b"9" * 5000 + b"}", r"malformed JSON \(Exceeds the limit"),
    (b'{"text": "al\\u0000pha"}', "field 'text' holds a NUL character at 2: binary data, not text"),
], ids=["malformed", "not-utf8", "not-an-object", "lone-surrogate", "nested-too-deep", "huge-integer", "nul-escape"])
@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_bad_jsonl_line_is_named_by_file_and_line(tokenizer, tmp_path, line, message, suffix):
    """Blank lines count: the number is the line an editor shows, also inside a .gz."""
    path = jsonl(tmp_path / f"d{suffix}", {"text": "alpha"}, "", "  ", line, {"text": "beta"})
    with pytest.raises(ValueError, match=rf"d{suffix.replace('.', '[.]')}:4: {message}"):
        preprocess([path], str(tmp_path / "out"), tokenizer, batch_size=2)


def test_a_damaged_parquet_file_is_named(tokenizer, tmp_path):
    """pyarrow's own words ("Corrupt snappy compressed data") name no file: the error names it, and
    where the damage was found (its footer, or the rows from some row on)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [f"document {i} " * 40 for i in range(400)]}), tmp_path / "d.parquet",
                   compression="snappy", row_group_size=100)
    data = bytearray((tmp_path / "d.parquet").read_bytes())
    data[1000:1400] = bytes(b ^ 0x5A for b in data[1000:1400])  # inside the first row group's pages
    (tmp_path / "d.parquet").write_bytes(bytes(data))
    (tmp_path / "e.parquet").write_bytes(b"not parquet at all" * 8)
    with pytest.raises(ValueError, match=r"d\.parquet: cannot read the rows from 0 as Parquet \(.*\); the file is damaged"):
        preprocess([str(tmp_path / "d.parquet")], str(tmp_path / "out"), tokenizer)
    with pytest.raises(ValueError, match=r"e\.parquet: cannot read its footer as Parquet"):
        preprocess([str(tmp_path / "e.parquet")], str(tmp_path / "out"), tokenizer)


def test_parquet_null_is_named_by_row(tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["alpha", "beta", None]}), tmp_path / "d.parquet", row_group_size=2)
    with pytest.raises(ValueError, match=r"d\.parquet: row 2: field 'text' is null"):
        preprocess([str(tmp_path / "d.parquet")], str(tmp_path / "out"), tokenizer, batch_size=2)
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    with pytest.raises(ValueError, match=r"n\.parquet: row 0: field 'text' is a number"):
        preprocess([str(tmp_path / "n.parquet")], str(tmp_path / "out"), tokenizer)


def test_parquet_string_that_is_not_utf8_is_its_rows_bad_record(tokenizer, tmp_path):
    """pyarrow fails a whole batch on one such value, naming nothing: the error names the row, and
    --skip-bad-records skips that row alone; curation counts it and keeps the rest."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_pipeline.curate.shards import BadRecords, input_documents

    text = pa.array([b"alpha", b"\xffbeta", b"gamma"], type=pa.binary()).view(pa.string())
    ids = pa.array([b"a", b"b", b"\xfe"], type=pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": text, "id": ids}), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"d\.parquet: row 1: field 'text' is not UTF-8 \(byte 0 is b'\\xff'\)"):
        preprocess([str(tmp_path / "d.parquet")], str(tmp_path / "out"), tokenizer)
    stats = preprocess([str(tmp_path / "d.parquet")], str(tmp_path / "kept"), tokenizer, skip_bad_records=True)
    assert len(IndexedDataset(str(tmp_path / "kept_text_document"))) == 2, stats
    bad = BadRecords()
    kept = list(input_documents(str(tmp_path / "d.parquet"), "text", "id", False, bad))
    assert [doc_id for doc_id, _ in kept] == ["a"] and bad.counts == {"not UTF-8": 2}, (kept, bad.examples)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all" * 8)
    with pytest.raises(ValueError, match=r"junk\.parquet: cannot read its footer as Parquet"):
        list(input_documents(str(tmp_path / "junk.parquet"), "text", "id", False, BadRecords()))


def test_every_input_is_checked_before_the_first_is_read(tokenizer, tmp_path, monkeypatch):
    """A typo in the last input, or a parquet file without the column, was found only after every
    input before it had been tokenized: at corpus scale, hours thrown away."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import data_pipeline.preprocess as preprocess_module

    good = jsonl(tmp_path / "good.jsonl", {"text": "alpha"})
    pq.write_table(pa.table({"body": ["alpha"]}), tmp_path / "other.parquet")
    (tmp_path / "notes.txt").write_text("alpha")

    def no_reading(*args, **kwargs):
        raise AssertionError("an input was read before every input was checked")
    monkeypatch.setattr(preprocess_module, "iter_batches", no_reading)
    for last, said in (("typo.jsonl", "typo.jsonl: no such input file"), ("notes.txt", "notes.txt: unknown input type"),
                       ("other.parquet", r"other.parquet: no column \['text'\] \(columns: \['body'\]\)")):
        with pytest.raises((ValueError, FileNotFoundError), match=said):
            preprocess([good, str(tmp_path / last)], str(tmp_path / "out"), tokenizer)
    assert not list(tmp_path.glob("out*"))


def test_a_folder_of_jsonl_files_is_checked_file_by_file(tokenizer, tmp_path):
    """`datasets` read such a folder as one table, converting the second file's number and boolean to
    the first file's string type: '5' and 'true' became documents. Each file is now read as if given
    alone, in name order."""
    folder = tmp_path / "web"
    (folder / "sub").mkdir(parents=True)
    jsonl(folder / "a.jsonl", {"text": "alpha"})
    jsonl(folder / "sub" / "b.jsonl", {"text": "beta"}, {"text": 5}, {"text": True})
    (folder / "README.md").write_text("about these files")
    with pytest.raises(ValueError, match=r"web/sub/b\.jsonl:2: field 'text' is a number, not a string"):
        preprocess([str(folder)], str(tmp_path / "out"), tokenizer)
    stats = preprocess([str(folder)], str(tmp_path / "kept"), tokenizer, skip_bad_records=True)
    assert len(IndexedDataset(str(tmp_path / "kept_text_document"))) == 2, stats
    with pytest.raises(ValueError, match="has no splits for --hf-split validation"):
        preprocess([str(folder)], str(tmp_path / "split"), tokenizer, hf_split="validation")


def test_dataset_record_without_the_key_is_named_by_index(tokenizer, tmp_path):
    """datasets fills a key one record lacks with None: that is an error, never the text "None". It is
    named by its index counted over every batch (planted: each batch counted from the previous
    batch's length, which held for the first two batches only)."""
    import datasets

    records = [{"text": "alpha"}, {"text": "beta"}, {"text": "gamma"}, {"text": "delta"}, {"title": "epsilon"}]
    datasets.Dataset.from_list(records).save_to_disk(tmp_path / "hf")
    with pytest.raises(ValueError, match=r"hf: index 4: field 'text' is null"):
        preprocess([str(tmp_path / "hf")], str(tmp_path / "out"), tokenizer, batch_size=2)


MIXED = [{"text": "alpha beta"}, {"text": None}, b'{"text": ', b'{"text": "\xff"}', b"[1, 2]",
         {"text": {"nested": 1}}, {"text": ""}, {"text": "gamma"}]
SKIPPED = {"not text": 2, "malformed JSON": 1, "not UTF-8": 1, "not a JSON object": 1}


@pytest.mark.parametrize("workers", [1, 2])
def test_skip_bad_records_counts_them_by_reason(tokenizer, tmp_path, workers):
    path = jsonl(tmp_path / "d.jsonl", *MIXED)
    stats = preprocess([path], str(tmp_path / "out"), tokenizer, workers=workers, batch_size=3,
                       skip_bad_records=True)
    assert dict(stats.skipped) == SKIPPED and stats.bad_records == 5
    assert stats.documents == 3  # an empty string is text: it becomes a document of only EOD
    assert "skipped 5 bad records (1 malformed JSON, 1 not UTF-8, 1 not a JSON object, 2 not text)" in stats.summary()
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[2, 3, 0], [0], [4, 0]]


def test_skipped_record_leaves_every_key_shard(tokenizer, tmp_path):
    """A record bad in one key is left out of all of them, so the shards stay aligned."""
    path = jsonl(tmp_path / "d.jsonl", {"text": "alpha", "title": "beta"}, {"text": "gamma", "title": None},
                 {"text": "delta", "title": ""})
    stats = preprocess([path], str(tmp_path / "out"), tokenizer, keys=("text", "title"), skip_bad_records=True)
    assert stats.documents == 2 and dict(stats.skipped) == {"not text": 1}
    texts, titles = (IndexedDataset(str(tmp_path / f"out_{k}_document")) for k in ("text", "title"))
    assert [texts[i].tolist() for i in range(2)] == [[2, 0], [5, 0]]
    assert [titles[i].tolist() for i in range(2)] == [[3, 0], [0]]


@pytest.mark.parametrize("workers", [1, 2])
def test_an_input_file_without_one_good_record_is_refused_by_name(tokenizer, tmp_path, workers):
    """--skip-bad-records leaves out a broken line or two; an input of which not one record could be
    read is a file of another shape (a JSON array, objects printed over several lines), and the run
    went on without it, counting its lines as bad records. It is refused by name once read, among
    good inputs and over several batches, and nothing is written. (Planted: the tally not checked.)"""
    good = jsonl(tmp_path / "good.jsonl", {"text": "alpha"}, {"text": None})
    pretty = tmp_path / "pretty.json"
    pretty.write_text("".join(json.dumps({"text": w}, indent=2) + "\n" for w in WORDS))
    array = jsonl(tmp_path / "array.json", "[" + ", ".join(json.dumps({"text": w}) for w in WORDS) + "]")
    with pytest.raises(ValueError) as refused:
        preprocess([str(pretty), good], str(tmp_path / "out"), tokenizer, workers=workers, batch_size=2,
                   skip_bad_records=True)
    assert str(refused.value) == (f"{pretty}: not one of its 12 records could be read (12 malformed JSON): it is likely "
                                  "not JSON lines: one JSON document per line (a JSON array, or an object printed over "
                                  "several lines, is not); write each record on a line of its own")
    with pytest.raises(ValueError, match=r"array\.json:1: starts a JSON array, not JSON lines"):  # before any is read
        preprocess([good, array], str(tmp_path / "out"), tokenizer, workers=workers, batch_size=2,
                   skip_bad_records=True)
    assert not list(tmp_path.glob("out*"))
    body = jsonl(tmp_path / "body.jsonl", {"body": "alpha"}, {"text": 5})
    with pytest.raises(ValueError, match=r"body\.jsonl: not one of its 2 records could be read \(2 not text\): no "
                                         r"record holds 'text' as a string; choose the field with --json-keys"):
        preprocess([body, good], str(tmp_path / "out"), tokenizer, skip_bad_records=True)
    mixed = tmp_path / "mixed.jsonl"  # a field not text and a line not UTF-8: no field name would fix it
    mixed.write_bytes(b'{"text": 5}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"mixed\.jsonl: not one of its 2 records could be read \(1 not UTF-8, 1 not "
                                         r"text\): fix the file, or leave it out of the inputs$"):
        preprocess([str(mixed), good], str(tmp_path / "out"), tokenizer, skip_bad_records=True)


def test_cli_strict_by_default_and_skip_on_request(tokenizer, tmp_path, capsys):
    path = jsonl(tmp_path / "d.jsonl", *MIXED)
    argv = ["preprocess", "--input", path, "--tokenizer", tokenizer, "--output-prefix", str(tmp_path / "o"),
            "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "d.jsonl:2: field 'text' is null" in err[0]
    assert main(argv + ["--skip-bad-records", "--workers", "2"]) == 0
    assert "3 documents" in (out := capsys.readouterr().out) and "skipped 5 bad records" in out


def truncated_gz(path, data):
    Path(path).write_bytes(gzip.compress(data)[:-20])


def truncated_zst(path, data):
    import zstandard

    Path(path).write_bytes(zstandard.ZstdCompressor().compress(data)[:-20])


def corrupt_gz(path, data):
    Path(path).write_bytes(b"this is not gzip data\n" * 10)


TRUNCATED = "the file is truncated or corrupt"
NOT_GZIP = "not gzip data (it starts with b'this'), though named .gz"  # found before any input is read


@pytest.mark.parametrize("write, suffix, said", [(truncated_gz, ".gz", TRUNCATED), (truncated_zst, ".zst", TRUNCATED),
                                                 (corrupt_gz, ".gz", NOT_GZIP)],
                         ids=["truncated-gz", "truncated-zst", "not-gzip"])
def test_damaged_compressed_file_is_one_error_naming_it(tokenizer, tmp_path, capsys, write, suffix, said):
    path = str(tmp_path / f"d.jsonl{suffix}")
    write(path, b"".join(json.dumps({"text": f"alpha {i}"}).encode() + b"\n" for i in range(3000)))
    with pytest.raises((OSError, ValueError), match=rf"d\.jsonl\.(gz|zst): {re.escape(said)}"):
        preprocess([path], str(tmp_path / "out"), tokenizer)
    assert main(["preprocess", "--input", path, "--tokenizer", tokenizer, "--output-prefix", str(tmp_path / "o"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0]


def test_zst_of_several_frames_is_read_whole(tokenizer, tmp_path):
    """Concatenated frames (as pzstd or `cat a.zst b.zst` write them) are one stream."""
    import zstandard

    frames = [zstandard.ZstdCompressor().compress(json.dumps({"text": w}).encode() + b"\n") for w in WORDS]
    (tmp_path / "d.jsonl.zst").write_bytes(b"".join(frames))
    stats = preprocess([str(tmp_path / "d.jsonl.zst")], str(tmp_path / "out"), tokenizer)
    assert stats.documents == 4
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert np.concatenate([ds[i] for i in range(4)]).tolist() == [2, 0, 3, 0, 4, 0, 5, 0]


def zst_of_blocks(blocks: list[bytes]) -> tuple[bytes, list[int]]:
    """One zstd frame holding each of ``blocks`` as its own block, and where each block ends in it."""
    import zstandard

    cobj, out, ends = zstandard.ZstdCompressor().compressobj(), [], []
    for block in blocks:
        out += [cobj.compress(block), cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)]
        ends.append(sum(map(len, out)))
    return b"".join(out + [cobj.flush()]), ends


def _lines(n: int, first: int = 0) -> bytes:
    return b"".join(json.dumps({"text": f"alpha beta {i}"}).encode() + b"\n" for i in range(first, first + n))


def test_truncated_zst_reads_the_lines_of_its_whole_blocks(tokenizer, tmp_path):
    """One frame (as `zstd file.jsonl` writes) of five blocks of 100 lines, cut inside the fourth: the
    error counts the 300 lines of the whole blocks, and says why the cut block gives none."""
    data, ends = zst_of_blocks([_lines(100, 100 * b) for b in range(5)])
    path = tmp_path / "d.jsonl.zst"
    path.write_bytes(data[:(ends[2] + ends[3]) // 2])
    with pytest.raises(OSError, match=r"d\.jsonl\.zst: the file is truncated or corrupt \(read 300 lines, then "
                                      r"EOFError: .*only whole blocks of up to 128 KiB of text"):
        preprocess([str(path)], str(tmp_path / "out"), tokenizer)
    path.write_bytes(data[:ends[3]])  # cut where a block ends, not a frame: still truncated, nothing lost
    with pytest.raises(OSError, match=r"read 400 lines, then EOFError"):
        preprocess([str(path)], str(tmp_path / "out"), tokenizer)


def test_zst_cut_where_a_frame_ends_is_whole(tokenizer, tmp_path):
    """Frames are independent: a file of several that ends where one ends is a whole, shorter file."""
    import zstandard

    frames = [zstandard.ZstdCompressor().compress(_lines(100, 100 * f)) for f in range(3)]
    (tmp_path / "d.jsonl.zst").write_bytes(b"".join(frames[:2]))
    assert preprocess([str(tmp_path / "d.jsonl.zst")], str(tmp_path / "out"), tokenizer).documents == 200
    (tmp_path / "d.jsonl.zst").write_bytes(b"".join(frames) + frames[2][:len(frames[2]) // 2])
    with pytest.raises(OSError, match=r"d\.jsonl\.zst: the file is truncated or corrupt \(read 300 lines"):
        preprocess([str(tmp_path / "d.jsonl.zst")], str(tmp_path / "out2"), tokenizer)


def test_byte_order_mark_is_not_a_bad_record(tokenizer, tmp_path):
    (tmp_path / "d.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "alpha"}).encode() + b"\n")
    assert preprocess([str(tmp_path / "d.jsonl")], str(tmp_path / "out"), tokenizer).documents == 1
    assert load_tokenizer(tokenizer).encode("alpha") == [2]
