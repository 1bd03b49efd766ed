"""Interop with megatron-core: our shards load in its IndexedDataset with identical tokens, its
IndexedDatasetBuilder's shards load in ours, and our sample and blend indices equal those of its
compiled helpers for the same inputs, and the three GPT sample indices (documents over epochs, sample
starts, shuffle) equal those megatron-core's GPTDataset builds over the same shard."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from data_pipeline.blend import greedy_blend
from data_pipeline.gpt_samples import build_document_index, build_gpt_indices, build_sample_index
from data_pipeline.indexed import IndexedDataset, IndexedDatasetWriter

with warnings.catch_warnings():  # megatron-core warns at import about missing GPU extras
    warnings.simplefilter("ignore")
    mc_indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset",
                                     reason="megatron-core is not installed (pip install megatron-core)")
    mc_helpers = pytest.importorskip("megatron.core.datasets.helpers",
                                     reason="megatron-core's compiled dataset helpers are not importable")
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import Split


def random_docs(seed, n=50, high=60000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, size=int(rng.integers(0, 40))) for _ in range(n)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_our_shards_load_in_megatron(tmp_path, dtype):
    docs = random_docs(0)
    with IndexedDatasetWriter(str(tmp_path / "ours"), dtype) as w:
        for d in docs:
            w.add_document(d)
    theirs = mc_indexed.IndexedDataset(str(tmp_path / "ours"))
    assert len(theirs) == len(docs)
    for i, d in enumerate(docs):
        got = theirs[i]
        assert got.dtype == np.dtype(dtype)
        assert got.tolist() == d.tolist()
    assert theirs.document_indices.tolist() == list(range(len(docs) + 1))


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_shards_load_in_ours(tmp_path, dtype):
    docs = random_docs(1)
    prefix = str(tmp_path / "theirs")
    builder = mc_indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in docs:
        builder.add_item(torch.from_numpy(d.astype(np.int64)))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    ours = IndexedDataset(prefix)
    assert ours.dtype == np.dtype(dtype)
    assert [ours[i].tolist() for i in range(len(ours))] == [d.tolist() for d in docs]
    # and byte for byte the same files as our writer makes
    with IndexedDatasetWriter(str(tmp_path / "ours"), dtype) as w:
        for d in docs:
            w.add_document(d)
    for ext in (".bin", ".idx"):
        assert Path(prefix + ext).read_bytes() == Path(str(tmp_path / "ours") + ext).read_bytes()


def test_a_merge_keeps_the_documents_of_sentence_shards_as_megatron_does(tmp_path):
    """A shard of sentences (``preprocess_data.py --split-sentences``) holds several sequences per
    document; merged, every sequence became a document of its own, and Megatron's document-level
    datasets lost the documents. Our merge must write the files megatron-core's merge writes, an
    empty document (two equal entries) included. (Planted: the merged shard's document index written
    as one document a sequence; then rebuilt from its boundaries, which split a shard of one empty
    and one two-sentence document into two and dropped the empty one.)"""
    from data_pipeline.indexed import merge_shards

    prefixes = []
    for k, sentences in enumerate([[3, 1, 2], [0, 2], [2, 2]]):  # sentences per document, shard by shard
        prefix = str(tmp_path / f"sentences{k}")
        builder = mc_indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        for d, count in enumerate(sentences):
            for sentence in range(count):
                builder.add_item(torch.arange(1, 2 + d + sentence) + 10 * k)
            builder.end_document()
        builder.finalize(prefix + ".idx")
        prefixes.append(prefix)
    plain = str(tmp_path / "plain")  # one sequence a document, between two grouped shards
    with IndexedDatasetWriter(plain, np.uint16) as w:
        w.add_document(np.arange(5, 9))
    order = [prefixes[0], plain, prefixes[1], prefixes[2]]
    merged = merge_shards(order, str(tmp_path / "ours"))
    builder = mc_indexed.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    for prefix in order:
        builder.add_index(prefix)
    builder.finalize(str(tmp_path / "theirs.idx"))
    assert merged.document_indices.tolist() == [0, 3, 4, 6, 7, 7, 9, 11, 13]
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"theirs{ext}").read_bytes()


@pytest.mark.parametrize("seq_len,epochs,seed", [(7, 1, 0), (16, 3, 1), (2, 2, 2), (64, 4, 3)])
def test_sample_index_matches_megatron_helper(seq_len, epochs, seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 30, size=40).astype(np.int32)
    sizes[0] = max(sizes[0], 1)
    doc_index = build_document_index(np.arange(len(sizes)), epochs, np.random.RandomState(seed), False)
    ours = build_sample_index(sizes, doc_index, seq_len)
    theirs = mc_helpers.build_sample_idx(sizes, doc_index, seq_len, epochs, int(sizes.sum()), True, True)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [1, 1],
                                     [0.19336, 0.14336, 0.15652, 0.13017, 0.09446, 0.08962, 0.05689, 0.04771,
                                      0.02897, 0.01588, 0.01359, 0.01007, 0.00873, 0.00859, 0.00208]])
@pytest.mark.parametrize("compiled", [True, False], ids=["c", "python"])
def test_blend_matches_megatron_helper(weights, compiled, monkeypatch):
    """Both loops, the compiled one and the Python one used without a C compiler. (Planted: the Python
    loop's ties going to the last dataset, or its first samples weighed by i + 1; either loop weighing
    sample 0 as 0, not 1, which gives it to the first dataset, not the heaviest: every other blend
    here lists its heaviest first, so only [0.1, 0.6, 0.3] tells.)"""
    import data_pipeline.blend as blend

    if not compiled:
        monkeypatch.setattr(blend, "compiled_blend", lambda: None)
    size = 20_000
    w = np.asarray(weights, np.float64) / np.sum(weights)
    dataset_index = np.zeros(size, np.int16)
    sample_index = np.zeros(size, np.int64)
    mc_helpers.build_blending_indices(dataset_index, sample_index, w, len(w), size, False)
    ours_d, ours_s = greedy_blend(weights, size)
    np.testing.assert_array_equal(ours_d, dataset_index)
    np.testing.assert_array_equal(ours_s, sample_index)


class _Vocabulary:
    """The little of a tokenizer megatron-core's GPTDataset reads while it builds its indices."""

    vocab_size, eod, eos, pad = 60000, 0, 0, -1
    unique_identifiers = {"class": "test vocabulary"}


# 20 documents of 0-39 tokens (seed 5): 440 tokens an epoch, 54 samples of 8+1 tokens. Two epochs
# give 109 samples, not 2 x 54: the shared boundary token is counted once over the whole stream.
INDEX_SEQ_LEN, INDEX_PER_EPOCH, INDEX_TWO_EPOCHS = 8, 54, 109


@pytest.mark.parametrize("num_samples", [
    None,
    INDEX_PER_EPOCH,  # exactly one epoch: a second would reshuffle every sample
    INDEX_PER_EPOCH + 1,  # one sample into a second epoch, which is shuffled apart
    INDEX_PER_EPOCH + int(0.8 * INDEX_PER_EPOCH),  # a final epoch used exactly at the threshold: shuffled in
    INDEX_PER_EPOCH + int(0.8 * INDEX_PER_EPOCH) - 1,  # one sample below it: shuffled apart
    INDEX_TWO_EPOCHS + 1,  # a third epoch, apart after the samples of two whole epochs
    INDEX_TWO_EPOCHS + 44,  # a third epoch shuffled in with the other two
])
def test_gpt_indices_match_megatron_dataset(tmp_path, num_samples):
    """Which epochs a run reads and which samples are shuffled together decide the order of every
    sample a run trains on; Megatron's rules (the fewest epochs giving the samples, the final epoch
    shuffled apart below 80% use) are met at their boundaries, where an off-by-one changes them."""
    docs = random_docs(5, n=20)
    with IndexedDatasetWriter(str(tmp_path / "d"), np.uint16) as w:
        for d in docs:
            w.add_document(d)
    theirs_data = mc_indexed.IndexedDataset(str(tmp_path / "d"))
    assert int(theirs_data.sequence_lengths.sum()) == 440
    config = GPTDatasetConfig(random_seed=7, sequence_length=INDEX_SEQ_LEN, tokenizer=_Vocabulary(),
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                              path_to_cache=None, mmap_bin_files=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = GPTDataset(theirs_data, str(tmp_path / "d"), np.arange(len(docs), dtype=np.int32), num_samples,
                            Split.train, config)
    ours = build_gpt_indices(IndexedDataset(str(tmp_path / "d")).sizes, np.arange(len(docs)), INDEX_SEQ_LEN,
                             num_samples, seed=7)
    for key in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(ours[key], getattr(theirs, key), err_msg=key)
