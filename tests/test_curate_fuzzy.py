"""Fuzzy dedup: shingles, MinHash error against exact Jaccard, the LSH candidate curve, components,
and precision/recall of the verified edges on planted near-duplicates of real prose."""

from __future__ import annotations

import json
import os
import random
import re
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.curate import fuzzy_dedup as fz
from data_pipeline.curate.config import build_config
from data_pipeline.curate.demo import NEAR_KINDS, near_duplicate, stdlib_prose
from data_pipeline.curate.minhash import MinHasher, estimate, jaccard
from data_pipeline.curate.pipeline import run_pipeline


def char_shingles(text: str, n: int = 5) -> set:
    return {text[i:i + n] for i in range(max(1, len(text) - n + 1))}


def exact_jaccard(a: str, b: str) -> float:
    sa, sb = char_shingles(a), char_shingles(b)
    return len(sa & sb) / len(sa | sb)


@pytest.fixture(scope="module")
def prose():
    return stdlib_prose(max_docs=400)


def test_shingle_sets_are_the_character_5_grams_of_each_text(prose):
    texts = prose[:50] + ["abc", "", "héllo wörld ✓ 𝔘nicode"]
    hashes, offsets = MinHasher().shingles(texts)
    for i, text in enumerate(texts):
        mine = hashes[offsets[i]:offsets[i + 1]]
        assert len(mine) == len(char_shingles(text.ljust(5, "\0")))
        assert (np.diff(mine.astype(np.int64)) > 0).all()  # sorted, unique
    a, b = prose[0], near_duplicate(prose[0], "word_edits", random.Random(0))
    h, o = MinHasher().shingles([a, b])
    assert jaccard(h[o[0]:o[1]], h[o[1]:o[2]]) == pytest.approx(exact_jaccard(a, b), abs=1e-9)


def test_minhash_tracks_exact_jaccard_within_the_error_of_260_permutations(prose):
    rng = random.Random(0)
    pairs = []
    for text in prose[:300]:
        words = text.split(" ")
        keep = rng.uniform(0.3, 1.0)  # replace a random share of the words: Jaccard over the whole range
        other = " ".join(w if rng.random() < keep else rng.choice(["alpha", "beta", "gamma"]) for w in words)
        pairs.append((text, other))
    hasher = MinHasher()
    hashes, offsets = hasher.shingles([t for p in pairs for t in p])
    sig = hasher.signatures(hashes, offsets)
    z = []
    for k, (a, b) in enumerate(pairs):
        j = exact_jaccard(a, b)
        if 0.05 < j < 0.95:
            z.append((estimate(sig[2 * k], sig[2 * k + 1]) - j) / np.sqrt(j * (1 - j) / 260))
    z = np.array(z)
    assert len(z) > 200
    assert abs(z.mean()) < 0.2, "biased estimate"
    assert 0.7 < (z ** 2).mean() < 1.3, "error not that of 260 independent permutations"


def _sets_with_jaccard(rng: np.random.Generator, s: float, size: int = 400) -> tuple[np.ndarray, np.ndarray]:
    """Two sets of random 32-bit values, each of ``size``, with Jaccard exactly ``shared / (2 size - shared)``."""
    shared = int(round(2 * size * s / (1 + s)))
    values = rng.choice(2**32 - 2, 2 * size - shared, replace=False).astype(np.uint32) + 1
    return np.sort(values[:size]), np.sort(values[size - shared:])


@pytest.mark.parametrize("s", [0.5, 0.6, 0.7, 0.8, 0.9])
def test_lsh_candidate_rate_follows_the_banding_curve(s):
    rng = np.random.default_rng(int(s * 10))
    hasher = MinHasher(seed=int(s * 100))
    n = 400
    sets = [x for _ in range(n) for x in _sets_with_jaccard(rng, s)]
    offsets = np.cumsum([0] + [len(x) for x in sets])
    keys = hasher.band_keys(hasher.signatures(np.concatenate(sets), offsets))
    rate = (keys[0::2] == keys[1::2]).any(axis=1).mean()
    expected = 1 - (1 - s ** 13) ** 20
    assert abs(rate - expected) < 4 * np.sqrt(expected * (1 - expected) / n) + 0.01, (rate, expected)


def test_the_documented_candidate_rates_are_the_banding_curves():
    """docs/curation.md's rates are what a user picks a threshold by: each must be the curve's value
    at its similarity, to the digits the page gives."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "curation.md").read_text()
    sentence = " ".join(page[page.index("probability `1 - (1 - s^13)^20`"):].split("(tests")[0].split())
    rates = re.findall(r"([0-9.]+)% at ([0-9.]+)", sentence)
    assert len(rates) >= 4, sentence
    for percent, s in rates:
        expected = 100 * (1 - (1 - float(s) ** 13) ** 20)
        decimals = len(percent.partition(".")[2])
        assert abs(float(percent) - expected) <= 0.5 * 10 ** -decimals, (percent, s, expected)


def test_components_keep_the_first_document_whatever_the_edge_order():
    edges = [(7, 3), (3, 12), (20, 21), (12, 40), (21, 30)]
    for seed in range(5):
        shuffled = random.Random(seed).sample(edges, len(edges))
        a = np.array([min(e) for e in shuffled])
        b = np.array([max(e) for e in shuffled])
        nodes, roots = fz.connected_components(a, b)
        assert dict(zip(nodes.tolist(), roots.tolist())) == {3: 3, 7: 3, 12: 3, 40: 3, 20: 20, 21: 20, 30: 20}


def test_a_big_bucket_stays_connected_with_linear_pairs():
    members = np.arange(100, 300)
    pairs = fz._bucket_pairs(members, max_pairs=64)
    assert len(pairs) < 2 * len(members)
    nodes, roots = fz.connected_components(pairs[:, 0], pairs[:, 1])
    assert set(roots.tolist()) == {100} and len(nodes) == len(members)


def test_planted_near_duplicates_in_real_prose_precision_and_recall(tmp_path, prose):
    rng = random.Random(1)
    originals = prose[:300]
    planted = [near_duplicate(t, NEAR_KINDS[i % 4], rng) for i, t in enumerate(originals[:120])]
    texts = originals + planted
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    raw = {"input": {"paths": [str(path)], "shard_docs": 100}, "output": {"dir": str(tmp_path / "out")},
           "stages": ["fuzzy_dedup"], "executor": {"workers": 2}}
    run_pipeline(build_config(raw), log=lambda s: None)
    edges = map(json.loads, open(tmp_path / "out/01-fuzzy_dedup/edges.jsonl"))
    found = {tuple(sorted((e["id_a"], e["id_b"]))) for e in edges}
    shingles = [char_shingles(t) for t in texts]
    truth = {tuple(sorted((f"d{i}", f"d{j}"))) for i, j in combinations(range(len(texts)), 2)
             if 0.8 * max(len(shingles[i]), len(shingles[j])) <= min(len(shingles[i]), len(shingles[j]))  # else J < 0.8
             and len(shingles[i] & shingles[j]) >= 0.8 * len(shingles[i] | shingles[j])}
    assert len(truth) >= 100, "the planted set should hold at least the planted pairs"
    precision = len(found & truth) / len(found)
    recall = len(found & truth) / len(truth)
    assert precision >= 0.95 and recall >= 0.95, (precision, recall, len(truth))


@pytest.mark.parametrize("batch", [fz.BATCH, 3])
def test_shingle_reader_reads_each_document_with_few_files_open(tmp_path, prose, monkeypatch, batch):
    """Verification reads a document's shingle set by its global number; closing files beyond
    ``max_open`` (so a corpus of thousands of shards stays under the open-file limit) changes nothing.
    With shards longer than one batch of hashed documents (256; here 3), each document still reads
    its own set (planted: a later batch's offsets not moved past the earlier batches' shingles)."""
    monkeypatch.setattr(fz, "BATCH", batch)
    cfg = fz.FuzzyDedupConfig()
    shards = [prose[i:i + 7] for i in range(0, 35, 7)]
    prefixes = []
    for k, texts in enumerate(shards):
        path = tmp_path / f"shard-{k:05d}.jsonl"
        path.write_text("".join(json.dumps({"id": f"{k}-{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
        prefixes.append(str(tmp_path / f"sig-{k}"))
        fz.signature_shard(str(path), prefixes[-1], "text", cfg, 3)
    order = [(k, i) for i in range(7) for k in range(len(shards))]  # every read switches shard
    open_before = len(os.listdir("/proc/self/fd"))
    with fz.ShingleReader(prefixes, max_open=2) as reader:
        for k, i in order:
            expected = np.unique(cfg.hasher().shingles([shards[k][i]])[0])
            assert np.array_equal(np.unique(reader.shingle_set((k << fz.ROW_BITS) | i)), expected)
            assert len(reader.files) <= 2
            assert len(os.listdir("/proc/self/fd")) <= open_before + 4  # a closed shard closes both its files
    assert len(os.listdir("/proc/self/fd")) == open_before


def test_a_big_bucket_pairs_each_member_with_its_neighbour():
    """Past ``max_pairs`` a bucket pairs each member with the first and with its predecessor: a
    near-duplicate like its neighbour but not the first document is still verified."""
    pairs = {tuple(p) for p in fz._bucket_pairs(np.arange(100, 300), 64).tolist()}
    assert (150, 151) in pairs and (100, 299) in pairs and len(pairs) == 2 * 200 - 3
    assert len({tuple(p) for p in fz._bucket_pairs(np.arange(10), 64).tolist()}) == 45
    assert len({tuple(p) for p in fz._bucket_pairs(np.arange(64), 64).tolist()}) == 64 * 63 // 2  # not more


def test_a_threshold_of_one_removes_identical_documents(tmp_path, prose):
    """Exact Jaccard 1.0 passes a threshold of 1.0 (>=, not >)."""
    path = tmp_path / "twins.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in (prose[0], prose[0], prose[1])))
    raw = {"input": {"paths": [str(path)]}, "output": {"dir": str(tmp_path / "out")}, "stages": ["fuzzy_dedup"],
           "fuzzy_dedup": {"threshold": 1.0}}
    stats = run_pipeline(build_config(raw), log=lambda s: None)
    kept = [json.loads(line)["text"] for shard in stats["shards"] for line in open(shard)]
    assert kept == [prose[0], prose[1]]
    # the audit files: each edge once (however many bands found it), the component's size with the removal
    stage = tmp_path / "out" / "01-fuzzy_dedup"
    edges = [json.loads(line) for line in open(stage / "edges.jsonl")]
    assert [(e["id_a"], e["id_b"]) for e in edges] == [("twins.jsonl:1", "twins.jsonl:2")]
    assert stats["stages"][-1]["edges"] == 1
    assert [json.loads(line) for line in open(stage / "removed.jsonl")] == \
        [{"id": "twins.jsonl:2", "kept": "twins.jsonl:1", "component_size": 2}]
    stage_stats = stats["stages"][-1]  # 20 bands, each one bucket of the twins; one component of two
    assert (stage_stats["buckets"], stage_stats["components"], stage_stats["cluster_sizes"]) == (20, 1, {"2": 1})
    # the documents it says it removed are the ones dropped (planted: every member of a component counted)
    assert stage_stats["removed"] == stage_stats["dropped"]["near duplicate"] == 1


def test_a_document_longer_than_a_block_has_the_signature_of_the_formula():
    """Documents of more than CHUNK shingles take a running minimum over pieces; each must still be
    min over its shingles of (a h + b) mod 2^32 (the offset dropped there biased only long documents)."""
    from data_pipeline.curate.minhash import CHUNK

    rng = np.random.default_rng(0)
    hasher = MinHasher()
    sets = [np.sort(rng.choice(2**32, k, replace=False)).astype(np.uint32) for k in (5, 3 * CHUNK + 7, 9)]
    signatures = hasher.signatures(np.concatenate(sets), np.cumsum([0] + [len(s) for s in sets]))
    for shingles, row in zip(sets, signatures):
        want = (hasher.perm[:, None].astype(np.uint64) * shingles + hasher.offset[:, None]) % 2**32
        assert np.array_equal(row, want.min(axis=1).astype(np.uint32))


def test_a_text_shorter_than_a_shingle_is_padded_with_nul():
    """(Found by planting bugs.) "ab" is the one shingle "ab\\0\\0\\0"; padded with spaces it was the
    shingle of the text "ab   ", and the two texts were one."""
    hashes, offsets = MinHasher().shingles(["ab", "ab   ", "ab\0\0\0"])
    sets = [hashes[offsets[i]:offsets[i + 1]].tolist() for i in range(3)]
    assert sets[0] == sets[2] != sets[1]


def test_the_seed_chooses_the_shingle_hash_and_the_permutations(prose):
    """(Found by planting bugs.) ``fuzzy_dedup.seed`` is an option: another seed, other hashes and
    signatures; the same seed, the same ones."""
    def signature(seed):
        hasher = MinHasher(seed=seed)
        hashes, offsets = hasher.shingles(prose[:2])
        return hashes, hasher.signatures(hashes, offsets)
    (h1, s1), (h1_again, s1_again), (h2, s2) = signature(1), signature(1), signature(2)
    assert np.array_equal(h1, h1_again) and np.array_equal(s1, s1_again)
    assert not np.array_equal(h1, h2) and not np.array_equal(s1, s2)


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_shingle_files_of_each_npy_format_version_are_read_at_their_data(tmp_path, version):
    """(Found by planting bugs.) Formats 2 and 3 give the header length in 4 bytes, not 2."""
    array = np.arange(10, dtype=np.uint32)
    path = tmp_path / "a.npy"
    with open(path, "wb") as f:
        np.lib.format.write_array(f, array, version=version)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, array.nbytes, fz._npy_data_offset(fd, str(path))) == array.tobytes()
    finally:
        os.close(fd)


def test_edges_are_listed_in_document_order_whatever_the_partitions(tmp_path, prose):
    """(Found by planting bugs.) edges.jsonl lists each edge once, by (id_a, id_b), though the edges
    were verified in several partitions: the four asked for, not one per shard (the option sets how
    many tasks share the buckets and edges, so how much each holds; planted: the option ignored)."""
    texts = [prose[0], prose[1], prose[0], prose[2], prose[1], prose[0], prose[2], prose[1]]
    path = tmp_path / "copies.jsonl"
    path.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    raw = {"input": {"paths": [str(path)], "shard_docs": 3}, "output": {"dir": str(tmp_path / "out")},
           "stages": ["fuzzy_dedup"], "fuzzy_dedup": {"partitions": 4}}
    run_pipeline(build_config(raw), log=lambda s: None)
    edges = [(e["id_a"], e["id_b"]) for e in map(json.loads, open(tmp_path / "out/01-fuzzy_dedup/edges.jsonl"))]
    want = [(f"d{i}", f"d{j}") for i, j in combinations(range(len(texts)), 2) if texts[i] == texts[j]]
    assert edges == want
    for sub, suffix in (("buckets", "pairs"), ("edges", "npy")):
        made = sorted(name for name in os.listdir(tmp_path / "out/01-fuzzy_dedup" / sub) if name.endswith(suffix))
        assert made == [f"part-{p:05d}.{suffix}" for p in range(4)], sub


def test_candidate_pairs_spread_over_the_partitions():
    """Each verification task reads one partition's pairs, so a partition's share is what bounds its
    memory: pairs of documents in one shard, or of neighbours, spread evenly too (planted: every pair
    in partition 0, which left the output alone and one task holding every candidate, passed)."""
    rows = np.arange(2000, dtype=np.int64)
    for pairs in (np.stack([rows, rows + 1], axis=1), np.stack([rows, (np.int64(3) << fz.ROW_BITS) + rows], axis=1)):
        counts = np.bincount(fz._pair_partition(pairs, 4).astype(np.int64), minlength=4)
        assert counts.min() > 400, counts


def test_shingles_are_of_the_composed_text_and_a_pair_is_one_candidate(tmp_path, prose):
    """A text with its accents written as combining marks has the precomposed copy's shingles (they
    shared a twentieth of them: both survived without the clean stage); and two documents sharing all
    20 bands are one candidate pair, not 20 (the pair was listed once a band where only pairs filled
    the buckets)."""
    hasher = MinHasher()
    nfc, nfd = "Ti\u1ebfng Vi\u1ec7t c\u00f3 d\u1ea5u " * 4, "Tie\u0302\u0301ng Vie\u0323\u0302t co\u0301 da\u0302\u0301u " * 4
    assert np.array_equal(hasher.shingles([nfc])[0], hasher.shingles([nfd])[0])
    path = tmp_path / "twins.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in (prose[0], prose[0], nfc, nfd)))
    raw = {"input": {"paths": [str(path)]}, "output": {"dir": str(tmp_path / "out")}, "stages": ["fuzzy_dedup"]}
    stats = run_pipeline(build_config(raw), log=lambda s: None)["stages"][-1]
    assert (stats["candidate_pairs"], stats["dropped"]) == (2, {"near duplicate": 2})


@pytest.mark.parametrize("max_bucket_pairs, candidates", [(64, 10), (4, 7)])
def test_max_bucket_pairs_reaches_the_buckets(tmp_path, prose, max_bucket_pairs, candidates):
    """Five copies of a text share every band's bucket: all 10 pairs are candidates, or, past
    fuzzy_dedup.max_bucket_pairs, each copy paired with the first and its predecessor, 7 (planted:
    the stage kept the default 64, passed); either way four copies go."""
    path = tmp_path / "copies.jsonl"
    path.write_text("".join(json.dumps({"text": prose[0]}) + "\n" for _ in range(5)))
    raw = {"input": {"paths": [str(path)]}, "output": {"dir": str(tmp_path / "out")}, "stages": ["fuzzy_dedup"],
           "fuzzy_dedup": {"max_bucket_pairs": max_bucket_pairs}}
    stats = run_pipeline(build_config(raw), log=lambda s: None)["stages"][-1]
    assert (stats["candidate_pairs"], stats["dropped"]) == (candidates, {"near duplicate": 4})


def test_a_pair_is_one_candidate_however_many_partitions_find_it(tmp_path, prose):
    """Two copies share all 20 bands, whose keys fall in several of 4 partitions: each partition found
    the pair, and the stage's candidate count summed them (236 candidates for 93 pairs on the demo).
    (Planted: candidates counted where the buckets are.)"""
    path = tmp_path / "twins.jsonl"
    path.write_text("".join(json.dumps({"text": prose[0]}) + "\n" for _ in range(2)))
    raw = {"input": {"paths": [str(path)]}, "output": {"dir": str(tmp_path / "out")}, "stages": ["fuzzy_dedup"],
           "fuzzy_dedup": {"partitions": 4}}
    stats = run_pipeline(build_config(raw), log=lambda s: None)["stages"][-1]
    assert (stats["candidate_pairs"], stats["edges"], stats["buckets"]) == (1, 1, 20)


def test_audit_ids_are_found_past_65536_rows(tmp_path):
    """shard_docs allows shards past 2^16 documents: the audit files name a document by the row in
    the low 32 bits of its number (planted: 16 bits, which named row 65536 as row 0, passed)."""
    (tmp_path / "s0.ids.json").write_text(json.dumps(["first"]))
    (tmp_path / "s1.ids.json").write_text(json.dumps([f"r{i}" for i in range(65_537)]))
    gids = np.array([0, (1 << fz.ROW_BITS) | 65_536, 1 << fz.ROW_BITS])
    prefixes = [str(tmp_path / "s0"), str(tmp_path / "s1")]
    assert fz._ids_of(gids, prefixes) == {0: "first", int(gids[1]): "r65536", int(gids[2]): "r0"}


def test_the_signature_pass_hashes_with_the_configured_shape(tmp_path):
    """fuzzy_dedup.ngram, bands and rows reach the signature pass: "abcdefg" is five 3-grams, and each
    document has a key per band, each of its rows' minima (planted: 5-grams, or 20 bands of 13 rows,
    whatever was set, both passed)."""
    from data_pipeline.curate.exact_dedup import load_keyed

    cfg = fz.FuzzyDedupConfig(num_perm=16, bands=4, rows=3, ngram=3)
    shard = tmp_path / "shard.jsonl"
    shard.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(["abcdefg", "xyz"])))
    fz.signature_shard(str(shard), str(tmp_path / "sig"), "text", cfg, 1)
    assert np.load(tmp_path / "sig.offsets.npy").tolist() == [0, 5, 6]
    (keys,), rows = load_keyed(str(tmp_path / "sig.bands"), 0)
    hasher = MinHasher(16, 3, 4, 3, cfg.seed)
    hashes, offsets = hasher.shingles(["abcdefg", "xyz"])
    assert rows.tolist() == [0] * 4 + [1] * 4
    assert keys.tolist() == hasher.band_keys(hasher.signatures(hashes, offsets)).ravel().tolist()
