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
    assert stats["bad_examples"][0].startswith(f"{path}:{read + 1}: ") and "truncated or corrupt" in stats["bad_examples"][0]
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
