"""Indexed dataset: write/read round trip, the on-disk layout checked byte by byte without our
reader, merging, a clear error for every kind of corruption, and the largest token id of a shard,
scanned in bounded chunks and cached by content. (Writes that leave no half-made shard:
``test_data_indexed_writes.py``.)"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest

import data_pipeline.indexed as indexed
import data_pipeline.token_range as token_range
from data_pipeline.indexed import IndexedDataset, IndexedDatasetWriter, merge_shards, token_dtype
from data_pipeline.token_range import largest_token_id

DOCS = [[5, 6, 7], [1], [], [65000, 2, 3, 4, 9], [8, 8]]


def write(prefix, docs=DOCS, dtype=np.uint16):
    with IndexedDatasetWriter(str(prefix), dtype) as w:
        for d in docs:
            w.add_document(d)
    return str(prefix)


def test_round_trip(tmp_path):
    ds = IndexedDataset(write(tmp_path / "a"))
    assert len(ds) == len(DOCS) and ds.dtype == np.uint16
    assert [ds[i].tolist() for i in range(len(ds))] == DOCS
    assert ds.get(3, 1, 2).tolist() == [2, 3]
    assert ds.num_tokens == sum(map(len, DOCS))


def test_batched_writes_equal_single_writes(tmp_path):
    single = write(tmp_path / "single")
    with IndexedDatasetWriter(str(tmp_path / "batched"), np.uint16) as w:
        w.add_documents(np.concatenate([np.asarray(d, np.int64) for d in DOCS[:3]]), [len(d) for d in DOCS[:3]])
        w.add_documents(np.concatenate([np.asarray(d, np.int64) for d in DOCS[3:]]), [len(d) for d in DOCS[3:]])
    for ext in (".bin", ".idx"):
        assert Path(single + ext).read_bytes() == Path(str(tmp_path / "batched") + ext).read_bytes()


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4), (np.int64, 5), (np.uint8, 1)])
def test_idx_layout_bytes(tmp_path, dtype, code):
    """Parse the .idx with struct alone, exactly as the format is specified."""
    docs = [[1, 2, 3], [4], [5, 6]]
    prefix = write(tmp_path / "x", docs, dtype)
    raw = Path(prefix + ".idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17]) == (1,)
    assert raw[17] == code
    n_seq, n_doc = struct.unpack("<QQ", raw[18:34])
    assert (n_seq, n_doc) == (3, 4)
    item = np.dtype(dtype).itemsize
    off = 34
    assert struct.unpack("<3i", raw[off:off + 12]) == (3, 1, 2)
    assert struct.unpack("<3q", raw[off + 12:off + 36]) == (0, 3 * item, 4 * item)
    assert struct.unpack("<4q", raw[off + 36:off + 68]) == (0, 1, 2, 3)
    assert len(raw) == off + 68
    data = Path(prefix + ".bin").read_bytes()
    assert data == np.array([1, 2, 3, 4, 5, 6], dtype=np.dtype(dtype).newbyteorder("<")).tobytes()


def test_token_dtype_threshold():
    assert token_dtype(65499) == np.uint16 and token_dtype(65500) == np.int32


def test_merge(tmp_path):
    a = write(tmp_path / "a", DOCS[:2])
    b = write(tmp_path / "b", DOCS[2:])
    merged = merge_shards([a, b], str(tmp_path / "m"))
    assert [merged[i].tolist() for i in range(len(merged))] == DOCS
    whole = write(tmp_path / "whole")
    for ext in (".bin", ".idx"):
        assert Path(whole + ext).read_bytes() == Path(str(tmp_path / "m") + ext).read_bytes()


def test_merge_refuses_mixed_dtypes(tmp_path, monkeypatch):
    """Before any shard is copied (the check ran in the copy loop, after the shards before it)."""
    a = write(tmp_path / "a", DOCS[:2], np.uint16)
    b = write(tmp_path / "b", DOCS[2:], np.int32)
    monkeypatch.setattr(IndexedDatasetWriter, "add_shard", lambda *args: pytest.fail("a shard was copied"))
    with pytest.raises(ValueError, match="same token dtype"):
        merge_shards([a, b], str(tmp_path / "m"))
    assert not any(p.name.startswith("m.") for p in tmp_path.iterdir())
    monkeypatch.undo()  # a writer given a shard of another dtype refuses it too, rather than copy its bytes
    with pytest.raises(ValueError, match="same token dtype"), IndexedDatasetWriter(str(tmp_path / "w"), np.int32) as w:
        w.add_shard(IndexedDataset(a))
    assert not any(p.name.startswith("w.") for p in tmp_path.iterdir())


def test_merge_carries_a_shared_tokenizer_record_and_refuses_a_partial_one(tmp_path):
    """A merged record vouches for every document, so shards without one cannot join recorded ones."""
    from data_pipeline.shard_origin import read_origin, write_origin

    record = {"tokenizer_sha256": "ab" * 32, "vocab_size": 70000, "tokenizer": "t.json"}
    a, b, bare = write(tmp_path / "a", DOCS[:2]), write(tmp_path / "b", DOCS[2:]), write(tmp_path / "bare")
    for prefix in (a, b):
        write_origin(prefix, record)
    assert read_origin(str(merge_shards([a, b], str(tmp_path / "ab")).prefix)) == record
    assert read_origin(str(merge_shards([bare, bare], str(tmp_path / "bb")).prefix)) is None
    # either way round (planted: the shards after the first recorded one alone checked, which passed)
    for order in ([a, bare], [bare, a]):
        with pytest.raises(ValueError, match=f"{bare} records no tokenizer but {a} records t.json .*merge only "
                                             "unrecorded shards"):
            merge_shards(order, str(tmp_path / "m"))
    assert not any(p.name.startswith("m.") for p in tmp_path.iterdir())


def test_an_interrupt_as_a_merges_record_is_put_in_place_leaves_nothing(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM landing as the merged shard's tokenizer record reaches its name: the merge takes
    the record with the shard (planted: the record written past the writer, left alone in a folder it
    kept, and the re-run refused as existing)."""
    from data_pipeline.shard_origin import write_origin

    source = write(tmp_path / "src" / "a", DOCS)
    write_origin(source, {"tokenizer_sha256": "ab" * 32, "vocab_size": 70000, "tokenizer": "t.json"})
    rename = os.replace

    def replace_then_interrupt(src, dst):
        rename(src, dst)
        if str(dst).endswith(".tokenizer.json"):
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", replace_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        merge_shards([source], str(tmp_path / "out" / "m"), replace=False)
    assert os.listdir(tmp_path) == ["src"]


def test_shards_of_two_tokenizers_are_not_merged_and_one_rewritten_tokenizer_is_one(tmp_path):
    """Two tokenizer files are two tokenizers, unless both records hold the same pieces' digest (one
    vocabulary written as another file); records without that digest (written before it was kept)
    compare by file alone. (Planted: two records lacking the digest taken for the same tokenizer.)"""
    from data_pipeline.shard_origin import read_origin, write_origin

    a, b = write(tmp_path / "a", DOCS[:2]), write(tmp_path / "b", DOCS[2:])
    write_origin(a, {"tokenizer_sha256": "ab" * 32, "vocab_size": 70000, "tokenizer": "t.json"})
    write_origin(b, {"tokenizer_sha256": "cd" * 32, "vocab_size": 70000, "tokenizer": "u.json"})
    with pytest.raises(ValueError, match=f"{b} was tokenized with u.json .*, {a} with t.json .*must share a tokenizer"):
        merge_shards([a, b], str(tmp_path / "m"))
    first = {"tokenizer_sha256": "ab" * 32, "vocab_size": 70000, "tokenizer": "t.model", "pieces_sha256": "ee" * 32}
    write_origin(a, first)
    write_origin(b, {**first, "tokenizer_sha256": "cd" * 32, "tokenizer": "tokenizer.json"})
    assert read_origin(str(merge_shards([a, b], str(tmp_path / "m")).prefix)) == first


def test_a_record_left_beside_a_rewritten_shard_is_refused(tmp_path):
    """Another tool writing a shard at a recorded prefix leaves the old record behind; it must not vouch
    for the new documents (a tokenizer of the same or a smaller vocabulary passes every other check)."""
    from data_pipeline.shard_origin import read_origin, write_origin

    record = {"tokenizer_sha256": "ab" * 32, "vocab_size": 70000, "tokenizer": "t.json"}
    prefix = write(tmp_path / "a", DOCS[:2])
    write_origin(prefix, record)
    assert read_origin(prefix) == record
    for suffix in (".bin", ".idx"):
        os.unlink(prefix + suffix)
    write(tmp_path / "a", DOCS[1:])
    with pytest.raises(ValueError, match=f"a.tokenizer.json: was written for another {prefix}.idx .*preprocess "
                                         "the shard again, or delete the record"):
        read_origin(prefix)


def test_the_idx_digest_is_read_once_per_version_of_the_file(tmp_path, monkeypatch):
    """Readers, the tokenizer record and a checkpoint's shard record all ask for the ``.idx`` digest;
    a process reads the file once per version of it. A shard written again at the prefix is hashed
    anew, while a reader opened before keeps its own file's digest (planted: the digest of whatever
    the prefix holds now, for an older reader; the version left out of the key)."""
    import hashlib

    import data_pipeline.shard_files as shard_files
    from data_pipeline.shard_origin import read_origin, write_origin

    reads = []
    real = hashlib.sha256
    monkeypatch.setattr(shard_files.hashlib, "sha256", lambda *a: reads.append(1) or real(*a))
    prefix = write(tmp_path / "a", DOCS[:2])
    old = IndexedDataset(prefix)
    write_origin(prefix, {"tokenizer_sha256": "ab" * 32, "vocab_size": 70000})
    first = Path(prefix + ".idx").read_bytes()
    assert old.fingerprint == IndexedDataset(prefix).fingerprint == real(first).hexdigest()
    assert read_origin(prefix)["vocab_size"] == 70000
    assert len(reads) == 1
    write(tmp_path / "a", DOCS[1:])
    second = Path(prefix + ".idx").read_bytes()
    assert IndexedDataset(prefix).fingerprint == real(second).hexdigest() != real(first).hexdigest()
    assert len(reads) == 2
    assert old.fingerprint == real(first).hexdigest()  # from the older reader's own map
    assert len(reads) == 3


def test_an_idx_rewritten_in_place_is_a_new_version(tmp_path):
    """A rewrite in place keeps the inode: the size and the modification time each tell the versions
    apart (the same size written later; another size within one tick of a coarse clock). Planted: the
    version without its mtime; without its size (the digest of the file as first read)."""
    import hashlib

    from data_pipeline.shard_files import idx_sha256

    prefix = write(tmp_path / "a", DOCS[:2])
    path = Path(prefix + ".idx")
    first = path.read_bytes()
    assert idx_sha256(prefix)[0] == hashlib.sha256(first).hexdigest()
    st = os.stat(path)
    with open(path, "r+b") as f:  # the same inode and size, one byte changed, a later mtime
        f.seek(len(first) - 1)
        f.write(bytes([first[-1] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert idx_sha256(prefix)[0] == hashlib.sha256(path.read_bytes()).hexdigest() != hashlib.sha256(first).hexdigest()
    mtime = os.stat(path).st_mtime_ns
    with open(path, "ab") as f:  # one byte more, the mtime put back
        f.write(b"\0")
    os.utime(path, ns=(st.st_atime_ns, mtime))
    assert os.stat(path).st_ino == st.st_ino
    assert idx_sha256(prefix)[0] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_record_written_before_the_idx_digest_is_still_read(tmp_path):
    """Shards preprocessed by a version that did not record the ``.idx`` digest keep their record: it
    is read as it stands, not refused as written for another shard (every such shard would have to
    be preprocessed again)."""
    import json

    from data_pipeline.shard_origin import origin_path, read_origin

    record = {"tokenizer_sha256": "ab" * 32, "vocab_size": 70000, "tokenizer": "t.json"}
    prefix = write(tmp_path / "a", DOCS[:2])
    Path(origin_path(prefix)).write_text(json.dumps(record))
    assert read_origin(prefix) == record


def test_a_record_without_a_whole_vocabulary_size_is_damaged(tmp_path):
    """The vocabulary size is what a run compares with its model; a record without it as a whole number
    is named as damaged where it is read, not a KeyError later; so is one without the tokenizer's digest,
    which every comparison reads. (Planted: only the digest checked; only the size checked.)"""
    import json

    from data_pipeline.shard_origin import origin_path, read_origin

    prefix = write(tmp_path / "a", DOCS[:2])
    for record in ({"tokenizer_sha256": "ab" * 32}, {"tokenizer_sha256": "ab" * 32, "vocab_size": "70000"},
                   {"vocab_size": 70000}, {"tokenizer_sha256": None, "vocab_size": 70000}):
        Path(origin_path(prefix)).write_text(json.dumps(record))
        with pytest.raises(ValueError, match=r"a\.tokenizer\.json: damaged record of the shard's tokenizer"):
            read_origin(prefix)


def corrupt(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


N = len(DOCS)
HEADER_CORRUPTIONS = [  # (what, byte offset in the .idx, bytes written there, expected message)
    ("wrong magic", 0, b"NOTMAGIC!", r"a\.idx: not a Megatron indexed dataset"),
    ("wrong version", 9, struct.pack("<Q", 2), "version 2 is not supported"),
    ("unknown dtype code", 17, bytes([42]), r"a\.idx: unknown dtype code 42"),
    ("pointer past the end", 34 + 4 * N + 8 * (N - 1), struct.pack("<q", 10_000),
     rf"a\.idx: pointer of sequence {N - 1} is 10000"),
    # an .idx that claims int32 over a .bin of uint16 tokens no longer adds up
    ("dtype mismatch", 17, bytes([4]), "pointer of sequence 1|dtype does not match"),
]


@pytest.mark.parametrize("what, offset, data, message", HEADER_CORRUPTIONS, ids=[c[0] for c in HEADER_CORRUPTIONS])
def test_corrupt_index_is_named(tmp_path, what, offset, data, message):
    prefix = write(tmp_path / "a")
    corrupt(prefix + ".idx", offset, data)
    with pytest.raises(ValueError, match=message):
        IndexedDataset(prefix)


def test_truncated_bin(tmp_path):
    prefix = write(tmp_path / "a")
    size = os.path.getsize(prefix + ".bin")
    os.truncate(prefix + ".bin", size - 2)
    with pytest.raises(ValueError, match=r"a\.bin: .* the \.bin is truncated"):
        IndexedDataset(prefix)


def test_truncated_idx(tmp_path):
    prefix = write(tmp_path / "a")
    os.truncate(prefix + ".idx", os.path.getsize(prefix + ".idx") - 8)
    with pytest.raises(ValueError, match=r"a\.idx: index is .* bytes but its header"):
        IndexedDataset(prefix)
    os.truncate(prefix + ".idx", 10)
    with pytest.raises(ValueError, match=r"a\.idx: truncated index"):
        IndexedDataset(prefix)


def test_an_idx_longer_than_its_header_describes_is_refused(tmp_path):
    """Bytes past the document index (two indices written into one file, a copy appended to) mean
    the header does not describe the file. (Planted: only a short index refused.)"""
    prefix = write(tmp_path / "a")
    size = os.path.getsize(prefix + ".idx")
    with open(prefix + ".idx", "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(ValueError, match=rf"a\.idx: index is {size + 8} bytes but its header .* needs {size}"):
        IndexedDataset(prefix)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.idx: no such file .*; write one with `megazero preprocess`"):
        IndexedDataset(str(tmp_path / "nope"))


@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_a_prefix_given_with_its_files_suffix_is_told_the_prefix(tmp_path, suffix):
    """``data.blend: [[1, web_text_document.bin]]`` names a shard that is there; the line told the user
    to preprocess it again, not to drop the suffix."""
    prefix = write(tmp_path / "web_text_document")
    with pytest.raises(FileNotFoundError, match=rf"give the prefix without \{suffix}: {prefix}\)$"):
        IndexedDataset(prefix + suffix)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_largest_token_id_scans_every_chunk(tmp_path, monkeypatch, dtype):
    prefix = write(tmp_path / "a", [[5, 6], [], [9, 1, 65000, 2], [3]], dtype)
    monkeypatch.setattr(token_range, "SCAN_CHUNK_BYTES", 3 * np.dtype(dtype).itemsize)  # 3 tokens a chunk
    assert largest_token_id(prefix, str(tmp_path / "c1")) == 65000
    prefix = write(tmp_path / "b", [[5, 6], [7, 1, 2, 8, 70]], dtype)  # the largest alone in the last chunk
    assert largest_token_id(prefix, str(tmp_path / "c2")) == 70


def test_largest_token_id_is_cached_by_content(tmp_path, monkeypatch):
    prefix = write(tmp_path / "a")
    assert largest_token_id(prefix) == 65000
    assert os.path.isdir(tmp_path / "index-cache")  # beside the data by default
    scans = []
    real_scan = token_range._scan_largest
    monkeypatch.setattr(token_range, "_scan_largest", lambda *a: scans.append(1) or real_scan(*a))
    assert largest_token_id(prefix) == 65000 and not scans  # a second start reads the cache
    prefix = write(tmp_path / "a", DOCS[::-1])  # same counts, other order: another .idx
    assert largest_token_id(prefix) == 65000 and len(scans) == 1
    prefix = write(tmp_path / "a", [[1, 2, 3], [1], [], [60000, 2, 3, 4, 9], [8, 8]])  # the first .idx, new tokens
    os.utime(prefix + ".bin", ns=(1, 1))  # a new mtime even where the clock ticks coarsely
    assert largest_token_id(prefix) == 60000 and len(scans) == 2
    before = os.stat(prefix + ".bin")
    time.sleep(0.05)  # past the file system's clock tick
    with open(prefix + ".bin", "r+b") as f:  # an edit in place, its modification time set back
        f.write(np.array([61000], np.uint16).tobytes())
    os.utime(prefix + ".bin", ns=(before.st_atime_ns, before.st_mtime_ns))
    assert largest_token_id(prefix) == 61000 and len(scans) == 3


def test_largest_token_id_edge_cases(tmp_path):
    assert largest_token_id(write(tmp_path / "empty", [[], []]), str(tmp_path / "c")) == -1
    prefix = write(tmp_path / "neg", [[1, 2], [-5, 3]], np.int32)
    with pytest.raises(ValueError, match=r"neg\.bin: token 2 is -5, a negative id"):
        largest_token_id(prefix, str(tmp_path / "c"))
    prefix = write(tmp_path / "pad", [[1, 2, 3], [-1]], np.int32)  # -1, the padding some writers use
    with pytest.raises(ValueError, match=r"pad\.bin: token 3 is -1, a negative id"):
        largest_token_id(prefix, str(tmp_path / "c"))
    prefix = write(tmp_path / "float", [[1.5]], np.float32)
    with pytest.raises(ValueError, match=r"float\.bin: holds float32 values, not integer token ids"):
        largest_token_id(prefix, str(tmp_path / "c"))
    with pytest.raises(FileNotFoundError, match=r"nope\.idx"):
        largest_token_id(str(tmp_path / "nope"), str(tmp_path / "c"))


# --- found by planting bugs: each of these passed with its check removed --------------------------

def test_a_bin_longer_than_its_index_is_refused(tmp_path):
    prefix = write(tmp_path / "a")
    with open(prefix + ".bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ValueError, match=r"a\.bin: .* the \.bin is longer than its index"):
        IndexedDataset(prefix)


def test_a_document_index_that_falls_is_refused(tmp_path):
    prefix = write(tmp_path / "a")
    doc_idx = 34 + 12 * N
    corrupt(prefix + ".idx", doc_idx + 8 * 2, struct.pack("<qq", 4, 1))  # 0, 1, 4, 1, 4, 5
    with pytest.raises(ValueError, match=r"a\.idx: document index must rise from 0 to 5"):
        IndexedDataset(prefix)


@pytest.mark.parametrize("entry, value", [(0, 1), (N, N - 1)], ids=["not from 0", "not to the count"])
def test_a_document_index_that_rises_but_not_from_0_to_the_count_is_refused(tmp_path, entry, value):
    """A document index runs from 0 to the sequence count: one that rises from 1, or stops at 4 of 5
    sequences, leaves a sequence outside every document. (Planted: each end's check removed.)"""
    prefix = write(tmp_path / "a")
    corrupt(prefix + ".idx", 34 + 12 * N + 8 * entry, struct.pack("<q", value))
    with pytest.raises(ValueError, match=rf"a\.idx: document index must rise from 0 to {N}"):
        IndexedDataset(prefix)


def test_a_negative_length_is_named_even_where_the_pointers_agree(tmp_path):
    prefix = str(tmp_path / "a")
    with open(prefix + ".idx", "wb") as f:
        indexed.write_index(f, np.uint16, np.array([5, -2, 2], dtype=np.int32))  # pointers 0, 10, 6
    Path(prefix + ".bin").write_bytes(b"\0" * 10)
    with pytest.raises(ValueError, match=r"a\.idx: negative sequence length"):
        IndexedDataset(prefix)


def test_a_read_past_a_document_is_refused(tmp_path):
    """A read running over would return the next document's tokens as this one's."""
    ds = IndexedDataset(write(tmp_path / "a"))
    for offset, length in ((0, 4), (3, 1), (-1, 2), (1, -1)):  # a count of -1 would read to the end of the .bin
        with pytest.raises(IndexError, match=r"document 0 has 3 tokens"):
            ds.get(0, offset, length)
    assert ds.get(0, 1, 2).tolist() == [6, 7]


def test_lengths_that_do_not_sum_to_the_tokens_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"lengths sum to 4 but 5 tokens were given"), \
            IndexedDatasetWriter(str(tmp_path / "a"), np.uint16) as w:
        w.add_documents(np.arange(5), [2, 2])
    assert list(tmp_path.iterdir()) == []


def test_a_merge_without_records_removes_a_record_left_at_its_name(tmp_path):
    from data_pipeline.shard_origin import origin_path

    a, b = write(tmp_path / "a"), write(tmp_path / "b", DOCS[:2])
    out = str(tmp_path / "m")
    Path(origin_path(out)).write_text('{"stale": true}')
    merge_shards([a, b], out)
    assert not os.path.exists(origin_path(out))




def test_a_writers_index_is_hashed_once_for_its_record_and_its_readers(tmp_path, monkeypatch):
    """The record is written for the sealed ``.idx`` under its temporary name; renamed into place it
    is the same file, and a reader's digest in the same process reads it no second time (a corpus's
    ``.idx`` is gigabytes). (Planted: digests cached by path.)"""
    import data_pipeline.shard_files as shard_files
    from data_pipeline.shard_files import idx_sha256

    reads = []
    real = shard_files.sha256_of
    monkeypatch.setattr(shard_files, "sha256_of", lambda f: reads.append(1) or real(f))
    prefix = str(tmp_path / "s")
    w = IndexedDatasetWriter(prefix, np.uint16)
    w.add_document([1, 2, 3])
    w.seal()
    w.record_origin({"tokenizer_sha256": "ab" * 32, "vocab_size": 70000})
    w.publish()
    assert idx_sha256(prefix)[0] == json.loads((tmp_path / "s.tokenizer.json").read_text())["idx_sha256"]
    assert len(reads) == 1
