"""GPT samples: every sample equals the matching seq_len+1 window of the document stream
(checked against a plain per-token reference), epochs and splits behave, and the cached indices
are built once, even when several processes ask at the same time, and never outlive the shard
they were built for."""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

import data_pipeline.gpt_samples as gs
from data_pipeline.gpt_samples import GPTSamples, build_gpt_indices, parse_split, split_ranges
from data_pipeline.indexed import IndexedDataset, IndexedDatasetWriter


def make_dataset(path, n_docs=30, seed=0, max_len=25):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 1000, size=int(rng.integers(0, max_len))) for _ in range(n_docs)]
    docs[0] = np.array([7, 7, 7])
    with IndexedDatasetWriter(str(path), np.uint16) as w:
        for d in docs:
            w.add_document(d)
    return IndexedDataset(str(path)), docs


def reference_samples(docs, document_index, seq_len):
    """Per-token reference: concatenate documents in order and cut overlapping windows."""
    stream = [t for d in document_index for t in docs[d].tolist()]
    n = (len(stream) - 1) // seq_len
    return [stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)]


def test_parse_split():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    # an infinite share makes every share NaN (planted: only negative shares refused, which passed)
    for bad in ("a,b", "1,2,3,4", "0,0", "-1,2", "inf,1", "1,inf"):
        with pytest.raises(ValueError, match="split"):
            parse_split(bad)


@pytest.mark.parametrize("split", ["98,,2", "969,30,1,", ",1"])
def test_a_split_with_an_empty_part_is_refused(split):
    """An empty part was skipped, so ``98,,2`` (meant as no validation) read as 98,2: validation took
    2% of the documents and test none, without a word (Megatron refuses it too)."""
    with pytest.raises(ValueError, match=rf"split '{split}' must be comma-separated numbers such as '969,30,1'"):
        parse_split(split)


def test_split_ranges_cover_all_documents():
    assert split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges("8,1,1", 7) == [(0, 6), (6, 6), (6, 7)]


@pytest.mark.parametrize("seq_len,num_samples,seed", [(4, None, 0), (8, 50, 1), (3, 400, 2), (16, 90, 3)])
def test_samples_equal_reference_windows(tmp_path, seq_len, num_samples, seed):
    data, docs = make_dataset(tmp_path / "d", seed=seed)
    samples = GPTSamples(data, seq_len, num_samples, seed, cache_dir=str(tmp_path / "cache"))
    ref = reference_samples(docs, samples.document_index, seq_len)
    assert len(samples) == len(ref) >= (num_samples or 1)
    assert sorted(samples.shuffle_index.tolist()) == list(range(len(ref)))
    for i in range(len(samples)):
        assert samples[i].tolist() == ref[int(samples.shuffle_index[i])]
        assert len(samples[i]) == seq_len + 1


def test_consecutive_samples_share_their_boundary_token(tmp_path):
    data, _ = make_dataset(tmp_path / "d")
    samples = GPTSamples(data, 5, None, 0, cache_dir=str(tmp_path / "cache"))
    order = np.argsort(samples.shuffle_index)  # position of each unshuffled sample
    for j in range(len(samples) - 1):
        assert samples[order[j]][-1] == samples[order[j + 1]][0]


def test_epochs_cover_requested_samples_and_every_document():
    sizes = np.array([10, 0, 7, 3, 12], np.int32)
    docs = np.arange(5)
    idx = build_gpt_indices(sizes, docs, seq_len=4, num_samples=40, seed=0)
    epochs = len(idx["document_index"]) // len(docs)
    assert epochs == 6  # 32 tokens per epoch: 5 epochs give (160-1)//4 = 39 < 40 samples
    assert np.bincount(idx["document_index"], minlength=5).tolist() == [epochs] * 5


def test_partial_final_epoch_is_shuffled_separately():
    sizes = np.full(100, 10, np.int32)
    idx = build_gpt_indices(sizes, np.arange(100), seq_len=10, num_samples=120, seed=0)
    sans_final = (1000 - 1) // 10
    shuffle = idx["shuffle_index"]
    assert sorted(shuffle[:sans_final].tolist()) == list(range(sans_final))
    doc_index = idx["document_index"]
    assert sorted(doc_index[:100].tolist()) == list(range(100))  # first epoch alone
    assert sorted(doc_index[100:].tolist()) == list(range(100))


def test_the_final_epoch_apart_comes_last():
    """Three epochs, the last used for 21 of its 99 samples: the documents of the two whole epochs come
    first, shuffled together (each document twice), then the last epoch's; so do their samples, of
    which the two epochs' 2000 tokens give 199, not 2 x 99. (Planted: the lone epoch put first, which
    with two epochs, one each side, passed; the two epochs' samples counted as 2 x 99; the whole epochs
    shuffled apart too: each was caught only by the megatron-core comparison.)"""
    sizes = np.full(100, 10, np.int32)
    idx = build_gpt_indices(sizes, np.arange(100), seq_len=10, num_samples=220, seed=0)
    doc_index, shuffle = idx["document_index"], idx["shuffle_index"]
    assert len(doc_index) == 300 and len(shuffle) == 299
    assert np.bincount(doc_index[:200], minlength=100).tolist() == [2] * 100
    assert sorted(doc_index[:100].tolist()) != list(range(100))  # the two shuffled as one, not each apart
    assert sorted(doc_index[200:].tolist()) == list(range(100))
    assert sorted(shuffle[:199].tolist()) == list(range(199))
    assert sorted(shuffle[199:].tolist()) == list(range(199, 299))


def test_the_final_epochs_samples_are_shuffled_among_themselves():
    """(Found by planting bugs.) 100 documents of 10 tokens give 99 samples an epoch."""
    sizes = np.full(100, 10, np.int32)
    rest = build_gpt_indices(sizes, np.arange(100), seq_len=10, num_samples=120, seed=0)["shuffle_index"][99:]
    assert sorted(rest.tolist()) == list(range(99, 199)) and not np.array_equal(rest, np.sort(rest))


def test_the_shuffle_index_keeps_every_sample_past_16_bits():
    """A run of more than 65,536 samples: the shuffle must still be a permutation of all of them, each
    part within itself. (Planted: a 16-bit shuffle index, whose sample numbers wrapped, serving the
    first 65,536 samples again; every smaller test passed.)"""
    first, total = 40_000, 70_000
    shuffle = gs.build_shuffle_index(first, total, np.random.RandomState(0))
    assert np.array_equal(np.sort(shuffle[:first]), np.arange(first))
    assert np.array_equal(np.sort(shuffle[first:]), np.arange(first, total))


@pytest.mark.parametrize("num_samples, separate", [(177, True), (178, False), (190, False)])
def test_the_final_epoch_is_apart_only_below_the_threshold(num_samples, separate):
    """The last epoch is shuffled apart when it holds fewer than int(0.8 * 99) = 79 of its samples
    (Megatron's rule, whose sample order this follows); otherwise every sample is shuffled together."""
    sizes = np.full(100, 10, np.int32)
    shuffle = build_gpt_indices(sizes, np.arange(100), seq_len=10, num_samples=num_samples, seed=0)["shuffle_index"]
    assert (sorted(shuffle[:99].tolist()) == list(range(99))) == separate
    assert separate or (shuffle[:99] >= 99).any()


@pytest.mark.parametrize("num_samples", [None, 99])
def test_samples_that_fill_one_epoch_take_one_epoch(num_samples):
    """An extra epoch would double a validation set's length, every sample served twice."""
    idx = build_gpt_indices(np.full(100, 10, np.int32), np.arange(100), seq_len=10, num_samples=num_samples, seed=0)
    assert len(idx["document_index"]) == 100 and len(idx["shuffle_index"]) == 99


def test_epochs_are_the_fewest_that_give_the_samples():
    """The count of epochs in closed form equals the search one epoch at a time over many sizes, and a
    hundred million epochs of a tiny corpus are planned at once (the search took minutes there).
    (Planted: ``N seq_len`` without the shared token.)"""
    rng = np.random.default_rng(0)
    for _ in range(3000):
        tokens, seq_len = int(rng.integers(2, 400)), int(rng.integers(1, 50))
        if gs.samples_in(tokens, seq_len) == 0:
            continue
        wanted = int(rng.integers(1, 200))
        epochs = 1
        while gs.samples_in(epochs * tokens, seq_len) < wanted:
            epochs += 1
        assert gs.epoch_plan(tokens, seq_len, wanted)[0] == epochs, (tokens, seq_len, wanted)
    assert gs.epoch_plan(11, 10, 10**8)[0] == 10**8 * 10 // 11 + 1


def test_one_epoch_is_never_shuffled_apart():
    """The final epoch is shuffled apart only when there are others before it (even no samples take one
    epoch). Planted: a lone epoch short of the threshold marked apart."""
    per_epoch = gs.samples_in(1000, 10)
    for wanted in (0, 1, per_epoch // 10, per_epoch):
        assert gs.epoch_plan(1000, 10, wanted) == (1, False), wanted
    assert gs.epoch_plan(1000, 10, per_epoch + 1) == (2, True)


def test_validation_split_uses_its_own_documents(tmp_path):
    data, _ = make_dataset(tmp_path / "d", n_docs=40)
    valid = GPTSamples(data, 4, None, 0, split="3,1,0", which="valid", cache_dir=str(tmp_path / "cache"))
    assert set(valid.document_index.tolist()) <= set(range(30, 40))
    with pytest.raises(ValueError, match="leaves no documents for test"):
        GPTSamples(data, 4, None, 0, split="3,1,0", which="test", cache_dir=str(tmp_path / "cache"))


def test_a_sequence_length_below_one_is_refused(tmp_path):
    """Not a division by zero deep in the index build. (Planted: only a negative length refused.)"""
    data, _ = make_dataset(tmp_path / "d")
    with pytest.raises(ValueError, match="seq_len must be positive, got 0"):
        GPTSamples(data, 0, 10, 0, cache_dir=str(tmp_path / "cache"))


def test_too_little_data_names_the_dataset(tmp_path):
    with IndexedDatasetWriter(str(tmp_path / "tiny"), np.uint16) as w:
        w.add_document([1, 2, 3])
    with pytest.raises(ValueError, match=r"tiny: 1 documents hold 3 tokens, too few for one sample of 8\+1"):
        GPTSamples(IndexedDataset(str(tmp_path / "tiny")), 8, 10, 0, cache_dir=str(tmp_path / "cache"))
    with IndexedDatasetWriter(str(tmp_path / "empty"), np.uint16):
        pass
    # said as an empty shard, not as a split to change (planted: the check removed)
    with pytest.raises(ValueError, match=r"empty: holds no documents; preprocess it again"):
        GPTSamples(IndexedDataset(str(tmp_path / "empty")), 8, 10, 0, cache_dir=str(tmp_path / "cache"))


def test_same_description_is_loaded_not_rebuilt(tmp_path, monkeypatch):
    data, _ = make_dataset(tmp_path / "d")
    first = GPTSamples(data, 6, 70, 5, cache_dir=str(tmp_path / "cache"))

    def fail(*args, **kwargs):
        raise AssertionError("indices rebuilt although cached")

    monkeypatch.setattr(gs, "build_gpt_indices", fail)
    again = GPTSamples(data, 6, 70, 5, cache_dir=str(tmp_path / "cache"))
    np.testing.assert_array_equal(first.shuffle_index, again.shuffle_index)
    with pytest.raises(AssertionError, match="rebuilt"):
        GPTSamples(data, 6, 70, 6, cache_dir=str(tmp_path / "cache"))  # another seed is another index


def test_indices_are_built_where_the_file_system_gives_no_locks(tmp_path, monkeypatch):
    """NFS without its lock service refuses every lock (ENOLCK): the first run on such a folder died
    with a traceback before a step (planted: the error raised). Each process builds the indices then;
    one finding a file already put in place keeps it, since a rank may have it memory-mapped (planted:
    replaced); a build error is raised as itself; another error of the lock still stops the run."""
    import errno

    import data_pipeline.index_cache as index_cache

    data, _ = make_dataset(tmp_path / "d")
    cache = tmp_path / "cache"

    def refused(fd, operation, code=errno.ENOLCK):
        raise OSError(code, "No locks available")

    monkeypatch.setattr(index_cache.fcntl, "flock", refused)
    built = GPTSamples(data, 6, 70, 5, cache_dir=str(cache))
    files = {p.name: p.stat().st_ino for p in cache.glob("*.npy")}
    next(cache.glob("*-description.json")).unlink()  # as if another process built them meanwhile
    again = GPTSamples(data, 6, 70, 5, cache_dir=str(cache))
    assert {p.name: p.stat().st_ino for p in cache.glob("*.npy")} == files
    np.testing.assert_array_equal(built.shuffle_index, again.shuffle_index)
    assert np.array_equal(built[3], again[3]) and len(list(cache.glob("*-description.json"))) == 1

    def broken(*args, **kwargs):
        raise ZeroDivisionError("the build")

    real_build = gs.build_gpt_indices
    monkeypatch.setattr(gs, "build_gpt_indices", broken)
    with pytest.raises(ZeroDivisionError) as failed:
        GPTSamples(data, 6, 70, 6, cache_dir=str(cache))
    assert failed.value.__context__ is None  # not "during handling of" the refused lock
    monkeypatch.setattr(index_cache.fcntl, "flock", lambda fd, op: refused(fd, op, errno.EIO))
    with pytest.raises(OSError, match=r"\.lock: cannot be locked \(No locks available\)"):
        GPTSamples(data, 6, 70, 6, cache_dir=str(cache))
    # Lustre mounted without flock says ENOSYS, FUSE file systems EOPNOTSUPP: no locks either (planted:
    # ENOLCK alone, which refused every run there, blaming data.cache_dir)
    monkeypatch.setattr(gs, "build_gpt_indices", real_build)
    for seed, code in ((7, errno.ENOSYS), (8, errno.EOPNOTSUPP)):
        monkeypatch.setattr(index_cache.fcntl, "flock", lambda fd, op, code=code: refused(fd, op, code))
        assert len(GPTSamples(data, 6, 70, seed, cache_dir=str(cache))) == len(built)


def test_a_cached_file_deleted_is_rebuilt_and_a_damaged_one_named(tmp_path):
    """A file deleted from the cache (its description left) ended in a bare file-not-found error;
    the cache is derived data, so it is built again. A damaged one is named with what to delete."""
    data, _ = make_dataset(tmp_path / "d")
    cache = tmp_path / "cache"
    first = GPTSamples(data, 6, 70, 5, cache_dir=str(cache))
    shuffle = next(cache.glob("*-shuffle_index.npy"))
    shuffle.unlink()
    again = GPTSamples(data, 6, 70, 5, cache_dir=str(cache))
    np.testing.assert_array_equal(first.shuffle_index, again.shuffle_index)
    # overwritten, or left empty (a rename not yet on disk when the machine went down)
    for damage in (b"not an array", b""):
        shuffle.write_bytes(damage)
        with pytest.raises(ValueError, match=r"a cached index file cannot be read .*; delete the files .* and run "
                                             "again"):
            GPTSamples(data, 6, 70, 5, cache_dir=str(cache))


def test_a_write_cut_short_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A full disk stops the cache's write partway through an array: the partial file, under a
    temporary name nothing reads or removes, was left holding the space (another per rank and per
    retry). The cache folder keeps nothing but the lock, and a later build completes."""
    import errno

    data, _ = make_dataset(tmp_path / "d")
    cache = tmp_path / "cache"
    real_save = np.save

    def full(path, array, **kwargs):
        with open(path, "wb") as f:
            f.write(b"\x93NUMPY partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(np, "save", full)
    with pytest.raises(OSError, match="No space left"):
        GPTSamples(data, 6, 70, 5, cache_dir=str(cache))
    assert [p.suffix for p in cache.iterdir()] == [".lock"]
    monkeypatch.setattr(np, "save", real_save)
    assert len(GPTSamples(data, 6, 70, 5, cache_dir=str(cache))) >= 70
    assert not list(cache.glob("*.tmp-*"))


@pytest.mark.parametrize("change", ["seq_len", "num_samples", "seed", "split"])
def test_an_index_built_for_other_inputs_is_not_reused(tmp_path, change):
    """Each input of the index is in its cache key: with one of them changed, the same cache folder
    must give the index a fresh build would (planted: the split's document range left out of the
    key, so a training index over all documents was reused after data.split moved some of them to
    validation, where they would be both trained on and evaluated)."""
    data, _ = make_dataset(tmp_path / "d", n_docs=60)
    base = {"seq_len": 6, "num_samples": 70, "seed": 5, "split": "1"}
    # 300 samples need more epochs of the 60 documents than 70 do, so the index differs
    other = {**base, change: {"seq_len": 7, "num_samples": 300, "seed": 6, "split": "9,1,0"}[change]}
    GPTSamples(data, base["seq_len"], base["num_samples"], base["seed"], base["split"], cache_dir=str(tmp_path / "cache"))
    reused = GPTSamples(data, other["seq_len"], other["num_samples"], other["seed"], other["split"],
                        cache_dir=str(tmp_path / "cache"))
    fresh = GPTSamples(data, other["seq_len"], other["num_samples"], other["seed"], other["split"],
                       cache_dir=str(tmp_path / "fresh"))
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(reused, name), getattr(fresh, name), err_msg=name)


def test_seed_changes_order_but_not_content(tmp_path):
    data, _ = make_dataset(tmp_path / "d")
    a = GPTSamples(data, 6, None, 1, cache_dir=str(tmp_path / "cache"))
    b = GPTSamples(data, 6, None, 2, cache_dir=str(tmp_path / "cache"))
    assert a.document_index.tolist() != b.document_index.tolist()
    assert sorted(a.document_index.tolist()) == sorted(b.document_index.tolist())


def _build_in_process(prefix, cache_dir, queue):
    build_calls = []
    real = gs.build_gpt_indices

    def counting(*args, **kwargs):
        build_calls.append(1)
        time.sleep(0.5)  # long enough for every process to find no cache and wait on the lock
        return real(*args, **kwargs)

    gs.build_gpt_indices = counting
    samples = GPTSamples(IndexedDataset(prefix), 3, 5000, 9, cache_dir=cache_dir)
    queue.put((len(build_calls), samples.shuffle_index[:50].tolist(), samples[3].tolist()))


def test_concurrent_processes_build_once(tmp_path):
    """Four processes race for the same indices: exactly one builds, all read the same arrays.
    (Planted: the cache not looked at again once the lock is taken, so each waiting process built
    the indices again; it passed while the first build ended before the others looked.)"""
    make_dataset(tmp_path / "d", n_docs=300)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build_in_process, args=(str(tmp_path / "d"), str(tmp_path / "c"), queue))
             for _ in range(4)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sum(r[0] for r in results) == 1
    assert all(r[1:] == results[0][1:] for r in results)


def test_reordered_shard_gets_fresh_indices(tmp_path):
    """Same path, same document and token counts, another order: the cache must not serve the old
    indices (they would cut samples at the old document boundaries, or read past a document)."""
    _, docs = make_dataset(tmp_path / "d", n_docs=40, seed=4)
    GPTSamples(IndexedDataset(str(tmp_path / "d")), 5, 60, 0, cache_dir=str(tmp_path / "cache"))
    reordered = docs[::-1]
    with IndexedDatasetWriter(str(tmp_path / "d"), np.uint16) as w:
        for d in reordered:
            w.add_document(d)
    samples = GPTSamples(IndexedDataset(str(tmp_path / "d")), 5, 60, 0, cache_dir=str(tmp_path / "cache"))
    ref = reference_samples(reordered, samples.document_index, 5)
    assert [samples[i].tolist() for i in range(len(samples))] == [ref[int(j)] for j in samples.shuffle_index]


def test_identical_index_elsewhere_reuses_the_cache(tmp_path, monkeypatch):
    """The indices depend on the document sizes alone, so a copy of the shard needs no rebuild."""
    data, _ = make_dataset(tmp_path / "d")
    first = GPTSamples(data, 6, 70, 5, cache_dir=str(tmp_path / "cache"))
    for ext in (".bin", ".idx"):
        (tmp_path / f"copy{ext}").write_bytes((tmp_path / f"d{ext}").read_bytes())
    copy = IndexedDataset(str(tmp_path / "copy"))
    assert copy.fingerprint == data.fingerprint
    monkeypatch.setattr(gs, "build_gpt_indices", lambda *a, **k: pytest.fail("rebuilt for an identical .idx"))
    np.testing.assert_array_equal(GPTSamples(copy, 6, 70, 5, cache_dir=str(tmp_path / "cache")).shuffle_index,
                                  first.shuffle_index)


def test_sample_starts_past_2_to_the_31_tokens_are_kept():
    """A stream of over 2**31 tokens (a few epochs of a billion-token corpus): where each sample starts
    is counted in 64 bits. (Planted: the cumulative token counts summed in int32, which wrapped negative
    past 2**31 and placed every sample past the last document; every test of small data passed.)"""
    sizes = np.full(3, 2**30, np.int32)
    index = gs.build_sample_index(sizes, np.arange(3), 2**29)
    assert index.tolist() == [[0, 0], [0, 2**29], [1, 0], [1, 2**29], [2, 0], [2, 2**29]]


def test_document_numbers_past_int32_are_kept():
    """A shard of over 2**31 documents: the document index was int32 whatever the numbers, so the
    last documents' numbers wrapped negative and read other documents (from the end) unnoticed."""
    documents = np.arange(2**31 - 2, 2**31 + 2, dtype=np.int64)
    index = gs.build_document_index(documents, 2, np.random.RandomState(0), True)
    assert sorted(index.tolist()) == sorted(documents.tolist() * 2)
    small = gs.build_document_index(np.arange(10), 2, np.random.RandomState(0), False)
    assert small.dtype == np.int32  # Megatron's dtype wherever the numbers fit
