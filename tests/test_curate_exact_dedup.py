"""Exact dedup: which copy of a text is kept, what counts as the same text (case, white space, all 128
bits of its hash), the byte and drop counts, and documents told apart past 65,536 rows a shard."""

from __future__ import annotations

import json

import pytest

from data_pipeline.curate import pipeline
from data_pipeline.curate.config import build_config


def test_exact_dedup_keeps_each_texts_first_copy_in_order(tmp_path):
    """Copies differing only in case and spacing are one text; the copy kept is the first in
    corpus order, across shard boundaries, and the order of what is kept is the corpus's (planted:
    the hashes read last to first, which kept the last copy)."""
    texts = ["Alpha beta gamma", "delta epsilon", "ALPHA  beta gamma", "zeta", "delta   EPSILON", "eta",
             "alpha beta gamma", "zeta"]
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    raw = {"input": {"paths": [str(corpus)], "shard_docs": 3}, "output": {"dir": str(tmp_path / "out")},
           "stages": ["exact_dedup"]}
    result = pipeline.run_pipeline(build_config(raw), log=lambda s: None)
    kept = [json.loads(line)["id"] for shard in result["shards"] for line in open(shard)]
    assert kept == ["d0", "d1", "d3", "d5"]
    assert result["stages"][-1]["dropped"] == {"exact duplicate": 4}


def test_exact_dedup_tells_texts_apart_by_all_128_bits(tmp_path):
    """Two texts whose hashes share their low 64 bits are both kept; only equal 128-bit hashes drop the
    later copy (planted: the duplicate search reading the low half alone). A hash file of the former
    64-bit form is refused with the fix."""
    import numpy as np

    from data_pipeline.curate import exact_dedup, partitioned

    low = np.array([7, 7, 7, 9], dtype=np.uint64)
    high = np.array([1, 2, 1, 0], dtype=np.uint64)  # rows 0 and 2 equal; row 1 differs in its high half only
    exact_dedup.save_keyed(str(tmp_path / "s0"), [low, high], np.arange(4, dtype=np.int64), parts=1)
    exact_dedup.duplicates_in_partition([str(tmp_path / "s0")], 0, str(tmp_path / "drops"))
    assert exact_dedup.rows_to_drop([str(tmp_path / "drops")], 0).tolist() == [2]

    shard = tmp_path / "docs.jsonl"
    shard.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(["a b", "A  b", "c"])))
    exact_dedup.hash_shard(str(shard), str(tmp_path / "h"), "text", parts=2)
    halves = [exact_dedup.load_keyed(str(tmp_path / "h"), part, key_columns=2)[0] for part in range(2)]
    digests = sorted(int(lo) | int(hi) << 64 for (los, his) in halves for lo, hi in zip(los, his))
    assert digests == sorted(int.from_bytes(exact_dedup.text_hash(t), "little") for t in ["a b", "a b", "c"])

    partitioned.save(str(tmp_path / "old.part"), low % np.uint64(1), [low, np.arange(4, dtype=np.int64)], 1)
    with pytest.raises(ValueError, match=r"old\.part: 1 key columns where this version writes 2; delete"):
        exact_dedup.duplicates_in_partition([str(tmp_path / "old")], 0, str(tmp_path / "drops2"))


def test_exact_dedup_normalises_case_spaces_and_ends_and_counts_bytes(tmp_path, monkeypatch):
    """(Found by planting bugs.) Copies differing only in case, runs of spaces or other white space
    (tabs, newlines) or a trailing newline are one text; the stage's byte counts are UTF-8 bytes, not
    characters, and count what is kept; no drop, no count of drops; an array a killed task was writing
    never appears under its final name."""
    import numpy as np

    from data_pipeline.curate import exact_dedup

    assert len({exact_dedup.text_hash(t) for t in ("a b", " a b\n", "A  B", "a\tb", "a\n\nb")}) == 1
    # an accent precomposed or as a combining mark, whether or not the clean stage composed it first
    assert exact_dedup.text_hash("Vi\u1ec7t caf\u00e9") == exact_dedup.text_hash("Vie\u0323\u0302t cafe\u0301")
    shard = tmp_path / "docs.jsonl"
    shard.write_text(json.dumps({"id": "0", "text": "\u00e9" * 10}) + "\n")
    stats = exact_dedup.filter_shard(str(shard), str(tmp_path / "out.jsonl"), "text", [], 0, "exact duplicate")
    assert stats["bytes_in"] == stats["bytes_out"] == 20 and stats["dropped"] == {}
    shard.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(["\u00e9" * 10, "ab"])))
    exact_dedup.save_drops(str(tmp_path / "drops"), np.array([0]), 1)
    stats = exact_dedup.filter_shard(str(shard), str(tmp_path / "out.jsonl"), "text", [str(tmp_path / "drops")], 0,
                                     "exact duplicate")
    assert (stats["bytes_in"], stats["bytes_out"], stats["dropped"]) == (22, 2, {"exact duplicate": 1})

    def torn_save(path, array):
        with open(path, "wb") as f:
            f.write(b"x")
        raise OSError("killed")
    monkeypatch.setattr(exact_dedup.np, "save", torn_save)
    with pytest.raises(OSError):
        exact_dedup.save_array(str(tmp_path / "a.npy"), np.zeros(3))
    assert not (tmp_path / "a.npy").exists()


def test_exact_dedup_tells_documents_apart_past_65536_rows(tmp_path):
    """A document is found by (shard, row) packed in one integer; rows past 2^16 (shard_docs allows
    them) must not spill into the shard's bits, where the wrong document was dropped."""
    from data_pipeline.curate import exact_dedup as ex

    n = 65_537
    big, small = tmp_path / "shard-0.jsonl", tmp_path / "shard-1.jsonl"
    big.write_text("".join(json.dumps({"id": f"a{i}", "text": "dup" if i in (0, n - 1) else f"t{i}"}) + "\n"
                           for i in range(n)))
    small.write_text(json.dumps({"id": "b0", "text": "only"}) + "\n")
    prefixes = [str(tmp_path / "h0"), str(tmp_path / "h1")]
    for shard, prefix in zip((big, small), prefixes):
        ex.hash_shard(str(shard), prefix, "text", 2)
    drops = [str(tmp_path / f"d{p}") for p in range(2)]
    for p, drop in enumerate(drops):
        ex.duplicates_in_partition(prefixes, p, drop)
    assert ex.filter_shard(str(big), str(tmp_path / "o0.jsonl"), "text", drops, 0, "dup")["docs_out"] == n - 1
    assert ex.filter_shard(str(small), str(tmp_path / "o1.jsonl"), "text", drops, 1, "dup")["docs_out"] == 1


def test_shards_past_five_digits_are_listed_in_document_order(tmp_path):
    """Shards were listed by name: the 100000th input file's (``shard-100000-00000``) came between
    the 10000th's and the 10001st's, and so did its documents, in every later stage and the first
    copy a dedup keeps."""
    from data_pipeline.curate.shards import ingest_file, list_shards

    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps({"text": "the same text"}) + "\n")
    (tmp_path / "o").mkdir()
    for k in (100_000, 10_001, 10_000, 9_999):
        ingest_file(str(src), k, str(tmp_path / "o"), "jsonl", "text", "id", 1, False)
    (tmp_path / "o/shard-09999-100000.jsonl").write_text("")  # a file's 100001st shard
    names = [p.rsplit("/", 1)[1] for p in list_shards(str(tmp_path / "o"))]
    assert names == ["shard-09999-00000.jsonl", "shard-09999-100000.jsonl", "shard-10000-00000.jsonl",
                     "shard-10001-00000.jsonl", "shard-100000-00000.jsonl"]
