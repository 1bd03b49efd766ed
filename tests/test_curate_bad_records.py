"""Bad input records in a curation run: each counted by reason with its file and line and left out,
or with --strict fatal; a compressed file cut short counted where the reading stopped."""

from __future__ import annotations

import gzip
import json

import pytest

from tests.test_curate_pipeline import _cli, _docs, config, write_corpus

BAD_LINES = ['{"text": ', '{"body": "no text field"}', '[1, 2]', b'{"text": "caf\xe9"}']


def test_bad_records_are_counted_with_file_and_line(tmp_path, capsys):
    corpus = tmp_path / "raw.jsonl"
    write_corpus(tmp_path)
    with open(corpus, "ab") as f:
        for line in BAD_LINES:
            f.write((line if isinstance(line, bytes) else line.encode()) + b"\n")
    assert _cli(tmp_path, config(tmp_path, [str(corpus)])) == 0
    stats = json.loads((tmp_path / "out/00-input/stats.json").read_text())
    assert stats["bad_records"] == {"malformed JSON": 1, "not text": 1, "not a JSON object": 1, "not UTF-8": 1}
    assert stats["bad_examples"][0].startswith(f"{corpus}:53: malformed JSON")
    assert "4 bad records" in capsys.readouterr().out
    report = (tmp_path / "out/report.md").read_text()  # planted: the report without the examples, passed
    assert all(f"- `{example}`" in report for example in stats["bad_examples"]) and len(stats["bad_examples"]) == 4


def test_strict_makes_a_bad_record_fatal(tmp_path, capsys):
    corpus = write_corpus(tmp_path, extra_lines=('{"body": 1}',))
    assert _cli(tmp_path, config(tmp_path, [corpus]), "--strict") == 2
    err = capsys.readouterr().err
    assert f"{corpus}:53: no key 'text' (keys: ['body'])" in err and "--strict" in err
    assert len(err.strip().splitlines()) == 1


def _zstd(data: bytes) -> bytes:
    import zstandard
    return zstandard.ZstdCompressor(level=3).compress(data)


@pytest.mark.parametrize("suffix, compress", [("gz", gzip.compress), ("zst", _zstd)])
def test_truncated_compressed_file_is_counted_or_fatal(tmp_path, capsys, suffix, compress):
    # two independently compressed halves (gzip members, zstd frames), cut inside the second: the
    # first half's documents and what the decompressor yields of the second are read, and the cut
    # is counted at the line where the reading stopped
    docs = [json.dumps({"text": d}) + "\n" for d in _docs(40)]
    second = compress("".join(docs[20:]).encode())
    path = tmp_path / f"raw.jsonl.{suffix}"
    path.write_bytes(compress("".join(docs[:20]).encode()) + second[:len(second) // 2])
    assert _cli(tmp_path, config(tmp_path, [str(path)])) == 0
    stats = json.loads((tmp_path / "out/00-input/stats.json").read_text())
    read = stats["docs_out"]
    assert stats["bad_records"] == {"truncated file": 1} and 20 <= read < 40
    first = stats["bad_examples"][0]
    assert first.startswith(f"{path}:{read + 1}: ") and "truncated or corrupt" in first
    assert _cli(tmp_path, config(tmp_path, [str(path)], out="strict"), "--strict") == 2
    assert f"raw.jsonl.{suffix}: the file is truncated or corrupt" in capsys.readouterr().err


def test_truncated_single_frame_zst_keeps_its_whole_blocks(tmp_path, capsys):
    # one zstd frame (as `zstd file.jsonl` writes) of four blocks of 13 documents, cut inside the
    # third: the two whole blocks' 26 documents are kept, and the cut is counted at line 27
    import zstandard

    lines = [json.dumps({"text": d}) + "\n" for d in _docs(40)]
    cobj, data, ends = zstandard.ZstdCompressor(level=3).compressobj(), b"", []
    for first in range(0, 52, 13):
        data += cobj.compress("".join(lines[first:first + 13]).encode()) + cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
        ends.append(len(data))
    path = tmp_path / "raw.jsonl.zst"
    path.write_bytes(data[:(ends[1] + ends[2]) // 2])
    assert _cli(tmp_path, config(tmp_path, [str(path)])) == 0
    stats = json.loads((tmp_path / "out/00-input/stats.json").read_text())
    assert stats["docs_out"] == 26 and stats["bad_records"] == {"truncated file": 1}
    assert stats["bad_examples"][0].startswith(f"{path}:27: {path}: the file is truncated or corrupt (read 26 lines")
    assert "only whole blocks of up to 128 KiB of text" in stats["bad_examples"][0]
    assert _cli(tmp_path, config(tmp_path, [str(path)], out="strict"), "--strict") == 2
    assert "raw.jsonl.zst: the file is truncated or corrupt (read 26 lines" in capsys.readouterr().err


NOT_JSON_LINES = ("it is likely not JSON lines: one JSON document per line (a JSON array, or an object printed over "
                  "several lines, is not); write each record on a line of its own")


@pytest.mark.parametrize("text", ['[{"text": "a"}, {"text": "b"}]\n', '[\n{"text": "a"},\n{"text": "b"}\n]\n'])
def test_a_json_array_is_refused_before_any_input_is_read(tmp_path, capsys, text):
    """Printed one element a line, a JSON array's last line parses: that record was the file's one
    document and the others counted as bad records, the run going on. (Planted: no look at it.)"""
    corpus = write_corpus(tmp_path)
    (tmp_path / "array.json").write_text(text)
    assert _cli(tmp_path, config(tmp_path, [corpus, str(tmp_path / "array.json")])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"megazero curate: error: input.paths: {tmp_path / 'array.json'}:")
    assert "starts a JSON array, not JSON lines" in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, text, said", [
    ("pretty.json", '{\n  "text": "a"\n}\n{\n  "text": "b"\n}\n', "not one of its 6 records could be read (6 malformed "
     "JSON): " + NOT_JSON_LINES),
    ("body.jsonl", '{"body": "a"}\n{"body": "b"}\n', "not one of its 2 records could be read (2 not text): no record "
     "holds 'text' as a string; set input.text_field"),
])
def test_an_input_file_without_one_good_record_is_an_error(tmp_path, capsys, name, text, said):
    """Bad records are counted, not fatal, so that one broken line in a million does not stop a run; an
    input file of which not one record could be read is no such line, but a file of another shape,
    and a run without --strict went on without it, saying only "N bad records". The input stage is
    removed: the fix changes an input or input.text_field, so a rerun would discard it. (Planted: the
    check in ingest_file removed.)"""
    corpus = write_corpus(tmp_path)
    (tmp_path / name).write_text(text)
    assert _cli(tmp_path, config(tmp_path, [corpus, str(tmp_path / name)])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"megazero curate: error: input.paths: {tmp_path / name}: {said}"], err
    assert not (tmp_path / "out").exists()
    (tmp_path / "also.json").write_text(text)
    assert _cli(tmp_path, config(tmp_path, [str(tmp_path / name), corpus, str(tmp_path / "also.json")])) == 2
    assert f"{name}: {said} (and 1 more input files alike)" in capsys.readouterr().err


def test_only_the_first_twenty_bad_records_are_listed_and_every_one_counted(tmp_path):
    """stats.json lists where the first twenty bad records are, and counts all of them: a file of
    millions of bad lines would otherwise write each into the stats and the report (planted: no
    limit, passed), and a run of several files lists twenty in all."""
    from data_pipeline.curate.runner import merge_stats
    from data_pipeline.curate.shards import ingest_file

    (tmp_path / "o").mkdir()
    results = []
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text(json.dumps({"text": "a good document"}) + "\n" + "{not json\n" * 25)
        results.append(ingest_file(str(tmp_path / name), len(results), str(tmp_path / "o"), "jsonl", "text", "id",
                                   10, False))
    assert results[0]["bad_records"] == {"malformed JSON": 25}
    first = [f"{tmp_path / 'a.jsonl'}:{line}" for line in range(2, 22)]
    assert [e.split(": ")[0] for e in results[0]["bad_examples"]] == first
    merged = merge_stats(results)
    assert merged["bad_records"] == {"malformed JSON": 50} and merged["bad_examples"] == results[0]["bad_examples"]


def test_ids_keep_the_users_value_and_one_that_is_no_id_is_a_bad_record(tmp_path, capsys):
    """pandas writes an integer id column with a gap as floats: every id 1001.0 became FILE:LINE, as did
    true or an object, and the user's ids were lost without a word. A whole float is its integer;
    null and NaN are no id (FILE:LINE); any other value is a bad record (fatal under --strict)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = " ".join(f"w{i}" for i in range(30))
    ids = [1001.0, None, True, {"doc": 7}, "a7", 12, 2.5]
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps({"id": v, "text": text}) + "\n" for v in ids))
    pq.write_table(pa.table({"id": [1001.0, float("nan"), 3.0], "text": [text] * 3}), tmp_path / "ids.parquet")
    raw = config(tmp_path, [str(tmp_path / "ids.jsonl"), str(tmp_path / "ids.parquet")], stages=[])
    assert _cli(tmp_path, raw) == 0
    out = [json.loads(line)["id"] for shard in sorted((tmp_path / "out/00-input").glob("shard-*")) for line in open(shard)]
    assert out == ["1001", "ids.jsonl:2", "a7", "12", "1001", "ids.parquet:1", "3"]
    stats = json.loads((tmp_path / "out/00-input/stats.json").read_text())
    assert stats["bad_records"] == {"not an id": 3}
    assert stats["bad_examples"][0] == f"{tmp_path / 'ids.jsonl'}:3: field 'id' holds True, not an id (a string or " \
                                       "an integer)"
    assert _cli(tmp_path, {**raw, "output": {"dir": str(tmp_path / "strict")}}, "--strict") == 2
    assert "ids.jsonl:3: field 'id' holds True" in capsys.readouterr().err
