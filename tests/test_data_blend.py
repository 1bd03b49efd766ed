"""Blending: at every prefix each dataset stays within 2 samples of weight*N, the blend is
reproducible from (weights, seed), the MT-NLG preset loads, and blended samples are the right
samples of the right component datasets."""

from __future__ import annotations

import os

import numpy as np
import pytest
import yaml

from data_pipeline.blend import build_blended_samples, greedy_blend, load_blend_preset, parse_blend, resolve_blend
from data_pipeline.gpt_samples import GPTSamples
from data_pipeline.indexed import IndexedDataset, IndexedDatasetWriter

MTNLG = {"openwebtext2": 0.19336, "books3": 0.14336, "cc-2021-04": 0.15652, "cc-2020-50": 0.13017,
         "pile-cc": 0.09446, "realnews": 0.08962, "stackexchange": 0.05689, "wikipedia": 0.04771,
         "pubmed-abstracts": 0.02897, "github": 0.01588, "arxiv": 0.01359, "bookcorpus2": 0.01007,
         "gutenberg-pg19": 0.00873, "cc-stories": 0.00859, "nih-exporter": 0.00208}


def max_prefix_deviation(weights, size):
    dataset_index, sample_index = greedy_blend(weights, size)
    w = np.asarray(weights, np.float64) / np.sum(weights)
    onehot = np.zeros((size, len(w)))
    onehot[np.arange(size), dataset_index] = 1
    counts = np.cumsum(onehot, axis=0)  # counts after each prefix of N = 1..size samples
    n = np.arange(1, size + 1)[:, None]
    # each dataset's samples are numbered 0, 1, 2, ... in the order they are drawn
    for d in range(len(w)):
        assert sample_index[dataset_index == d].tolist() == list(range(int((dataset_index == d).sum())))
    return np.abs(counts - w[None, :] * n).max()


@pytest.mark.parametrize("weights", [list(MTNLG.values()), [0.5, 0.5], [0.9, 0.1], [1, 2, 3, 4],
                                     [0.001, 0.999], [0.3333, 0.3333, 0.3334]])
def test_every_prefix_stays_within_two_samples(weights):
    assert max_prefix_deviation(weights, 20_000) < 2.0


@pytest.mark.parametrize("seed", range(5))
def test_random_weights_stay_within_two_samples(seed):
    weights = np.random.default_rng(seed).random(int(3 + seed * 3)).tolist()
    assert max_prefix_deviation(weights, 10_000) < 2.0


def test_blend_is_deterministic():
    a = greedy_blend([0.2, 0.5, 0.3], 5000)
    b = greedy_blend([0.2, 0.5, 0.3], 5000)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_bad_blends_are_named():
    with pytest.raises(ValueError, match="must be \\[weight, prefix\\]"):
        parse_blend([["data/a", 0.5]])
    with pytest.raises(ValueError, match="non-negative"):
        parse_blend([[-1, "a"], [2, "b"]])
    with pytest.raises(ValueError, match="non-empty list"):
        parse_blend([])
    with pytest.raises(ValueError, match="must be \\[weight, prefix\\]"):  # YAML's true is no weight
        parse_blend([[True, "a"]])
    with pytest.raises(ValueError, match="must be \\[weight, prefix\\]"):  # nor is YAML's null a prefix
        parse_blend([[0.5, None], [0.5, "b"]])
    # a third item (a second dataset written into one entry) is not dropped (planted: taken, passed)
    with pytest.raises(ValueError, match="entry \\[0.5, 'a', 'b'\\] must be \\[weight, prefix\\]"):
        parse_blend([[0.5, "a", "b"]])
    with pytest.raises(ValueError, match="non-negative numbers with a positive sum"):  # every source off
        parse_blend([[0, "a"], [0.0, "b"]])
    with pytest.raises(ValueError, match="lists 32769 datasets, more than 32768"):  # the int16 index would wrap
        parse_blend([[1, f"d{i}"] for i in range(32769)])
    assert len(parse_blend([[1, f"d{i}"] for i in range(32768)])[1]) == 32768


@pytest.mark.parametrize("weight", [float("nan"), float("inf")])
def test_a_weight_that_is_not_a_finite_number_is_refused(weight):
    """A NaN weight made every comparison of the greedy loop false: every sample from dataset 0."""
    with pytest.raises(ValueError, match="non-negative numbers with a positive sum"):
        parse_blend([[weight, "a"], [1.0, "b"]])


def test_a_weight_yaml_reads_as_a_string_is_a_number(tmp_path):
    """YAML 1.1 reads 5e-1 (no dot) as a string, in data.blend and in a preset file alike; every float
    field of the config takes it, so a blend does too, and a string that is no number stays refused."""
    blend = yaml.safe_load("[[5e-1, a], [1e0, b]]")
    assert blend[0][0] == "5e-1"
    assert parse_blend(blend) == ([0.5, 1.0], ["a", "b"])
    assert resolve_blend(blend, None, None) == [[0.5, "a"], [1.0, "b"]]
    (tmp_path / "preset.yaml").write_text("datasets:\n  - [2.5e-1, web_text_document]\n"
                                          "  - [75e-2, wiki_text_document]\n")
    assert [w for w, _ in load_blend_preset(str(tmp_path / "preset.yaml"), "root")] == [0.25, 0.75]
    with pytest.raises(ValueError, match="must be \\[weight, prefix\\]"):
        parse_blend([["half", "a"]])


def test_a_weight_in_quotes_is_refused_naming_its_entry(tmp_path):
    """A quoted number is text, as in every float field of the config: ``["1", a]`` was taken as 1.0
    without a word. (Planted: blend_weight taking any string float() reads.)"""
    blend = yaml.safe_load('[["1", a], [1, b]]')
    with pytest.raises(ValueError) as refused:
        parse_blend(blend)
    assert str(refused.value) == ("data.blend entry ['1', 'a'] must be [weight, prefix], its weight a number "
                                  "(unquoted), e.g. [0.3, data/web_text_document]")
    (tmp_path / "preset.yaml").write_text('datasets:\n  - ["0.5", web_text_document]\n')
    with pytest.raises(ValueError, match=r"datasets\[0\] is \['0.5', 'web_text_document'\]; .*a number, unquoted"):
        load_blend_preset(str(tmp_path / "preset.yaml"), "root")


def test_a_dataset_listed_twice_is_refused(tmp_path):
    """Two entries for the same data would each serve every sample of one order: every sample twice.
    The same prefix, the same object, or the same files by another path or another name (symbolic or
    hard links) are one dataset. (Planted: paths resolved, the hard links passed.)"""
    prefix = str(tmp_path / "web_text_document")
    (tmp_path / "link").symlink_to(tmp_path)
    for other in (prefix, prefix + "", str(tmp_path / "." / "web_text_document"), str(tmp_path / "link" / "web_text_document")):
        also = "" if other == prefix else r" \(also as .*web_text_document\)"
        with pytest.raises(ValueError, match=rf"data.blend entry .*web_text_document is listed twice{also}; give it once"):
            parse_blend([[0.5, prefix], [0.2, "other"], [0.5, other]])
    with pytest.raises(ValueError, match="twice"):
        resolve_blend([[0.5, "a"], [0.5, "./a"]], None, None)
    for ext in (".bin", ".idx"):  # another prefix whose files are links to the first's
        (tmp_path / f"web_text_document{ext}").write_bytes(b"")
        (tmp_path / f"alias{ext}").symlink_to(tmp_path / f"web_text_document{ext}")
    with pytest.raises(ValueError, match=r"alias is listed twice \(also as .*web_text_document\); give it once"):
        parse_blend([[0.5, prefix], [0.5, str(tmp_path / "alias")]])
    for ext in (".bin", ".idx"):  # hard links: the same files under other names, which no path resolves to
        os.link(tmp_path / f"web_text_document{ext}", tmp_path / f"hard{ext}")
    with pytest.raises(ValueError, match=r"hard is listed twice \(also as .*web_text_document\); give it once"):
        parse_blend([[0.5, prefix], [0.5, str(tmp_path / "hard")]])


def test_a_preset_entry_of_weight_zero_is_refused(tmp_path):
    """A preset names the datasets of a published mixture, each with a positive share; a zero there is
    a mistake in the file, named with its entry. (Planted: only negative weights refused.)"""
    (tmp_path / "preset.yaml").write_text("datasets:\n  - [0.5, web_text_document]\n  - [0, wiki_text_document]\n")
    with pytest.raises(ValueError, match=r"preset\.yaml: datasets\[1\] is \[0, 'wiki_text_document'\]; .* positive"):
        load_blend_preset(str(tmp_path / "preset.yaml"), "root")
    # an entry of three items (planted: taken as its first two)
    (tmp_path / "preset.yaml").write_text("datasets:\n  - [0.5, web_text_document, 0.5]\n")
    with pytest.raises(ValueError, match=r"datasets\[0\] is \[0.5, 'web_text_document', 0.5\]; each entry is \["):
        load_blend_preset(str(tmp_path / "preset.yaml"), "root")


def test_a_preset_names_its_datasets_under_the_root_folders_and_all(tmp_path):
    """A preset may keep its datasets in folders of blend_root; each name is a path under it. (Planted:
    each name's folders dropped, which every preset shipped, of bare names, passed.)"""
    (tmp_path / "preset.yaml").write_text("datasets:\n  - [0.5, web/cc_text_document]\n  - [0.5, wiki_text_document]\n")
    assert load_blend_preset(str(tmp_path / "preset.yaml"), "root") == [[0.5, "root/web/cc_text_document"],
                                                                         [0.5, "root/wiki_text_document"]]


def test_mtnlg_preset():
    blend = load_blend_preset("mtnlg530b", "root")
    assert [w for w, _ in blend] == list(MTNLG.values())
    assert [p for _, p in blend] == [f"root/{name}_text_document" for name in MTNLG]
    assert sum(w for w, _ in blend) == pytest.approx(1.0, abs=1e-4)
    with pytest.raises(ValueError, match="known presets: .*mtnlg530b"):
        load_blend_preset("nope", "root")


def test_resolve_blend_from_config_values():
    assert resolve_blend([[1, "a"], [3, "b"]], None, None) == [[1.0, "a"], [3.0, "b"]]
    assert resolve_blend(None, "mtnlg530b", "root")[0] == [0.19336, "root/openwebtext2_text_document"]
    with pytest.raises(ValueError, match="exactly one of data.blend"):
        resolve_blend(None, None, None)
    with pytest.raises(ValueError, match="exactly one of data.blend"):  # both: one would be ignored
        resolve_blend([[1, "a"]], "mtnlg530b", "root")
    with pytest.raises(ValueError, match="needs data.blend_root"):
        resolve_blend(None, "mtnlg530b", None)


def make_shard(path, seed, n_docs=40):
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(str(path), np.uint16) as w:
        for _ in range(n_docs):
            w.add_document(rng.integers(0, 1000, size=int(rng.integers(1, 30))))
    return str(path)


def build(tmp_path, seed, split="1", which="train"):
    prefixes = [make_shard(tmp_path / f"d{i}", i) for i in range(3)]
    blend = [[0.6, prefixes[0]], [0.3, prefixes[1]], [0.1, prefixes[2]]]
    return build_blended_samples(blend, 8, 300, seed, split, which, cache_dir=str(tmp_path / "cache")), prefixes


@pytest.mark.parametrize("split, which", [("1", "train"), ("3,1,0", "valid")])
def test_blended_samples_come_from_their_components(tmp_path, split, which):
    """A validation blend must draw from each dataset's validation documents: built from the
    training ones, it would report the loss of text the model was trained on."""
    blended, prefixes = build(tmp_path, 3, split, which)
    assert len(blended) == 300
    components = [GPTSamples(IndexedDataset(p), 8, int(c), 3, split, which, cache_dir=str(tmp_path / "cache"))
                  for p, c in zip(prefixes, np.bincount(blended.dataset_index, minlength=3))]
    for i in range(len(blended)):
        d, s = int(blended.dataset_index[i]), int(blended.sample_index[i])
        assert blended[i].tolist() == components[d][s].tolist()
    assert np.bincount(blended.dataset_index).tolist() == [180, 90, 30]


def test_whole_blend_reproducible_from_weights_and_seed(tmp_path):
    first, _ = build(tmp_path / "a", seed=11)
    again, _ = build(tmp_path / "b", seed=11)  # fresh cache: rebuilt from scratch
    other, _ = build(tmp_path / "c", seed=12)
    tokens = [[x[i].tolist() for i in range(len(x))] for x in (first, again, other)]
    assert tokens[0] == tokens[1]
    assert tokens[0] != tokens[2]


@pytest.mark.parametrize("change", ["weights", "size", "rule"])
def test_a_blend_changed_in_the_same_cache_is_rebuilt(tmp_path, monkeypatch, change):
    """New weights for the same datasets, more samples (a longer run) or a newer blend rule, the cache
    beside them kept (as when a user re-weights data.blend and relaunches): the blend must be the one
    a fresh build gives, not the cached old one. (Planted: the sample count or the rule left out of
    the cache key: a longer run then had too few samples, an upgrade drew by the old rule.)"""
    import data_pipeline.blend as blend

    prefixes = [make_shard(tmp_path / f"d{i}", i) for i in range(2)]
    build_blended_samples([[0.8, prefixes[0]], [0.2, prefixes[1]]], 8, 100, 0, cache_dir=str(tmp_path / "cache"))
    weights, size = ([0.2, 0.8], 100) if change == "weights" else ([0.8, 0.2], 150 if change == "size" else 100)
    if change == "rule":  # a stand-in for a rule that draws otherwise: every sample from the second dataset
        monkeypatch.setattr(blend, "BLEND_RULE", blend.BLEND_RULE + 1)
        monkeypatch.setattr(blend, "greedy_blend", lambda w, n: (np.ones(n, np.int16), np.arange(n, dtype=np.int64)))
    again, fresh = (build_blended_samples([[w, p] for w, p in zip(weights, prefixes)], 8, size, 0,
                                          cache_dir=str(tmp_path / cache)) for cache in ("cache", "fresh"))
    assert again.dataset_index.tolist() == fresh.dataset_index.tolist()
    assert len(again) == size and (change != "weights" or np.bincount(again.dataset_index).tolist() == [20, 80])


def test_a_zero_weight_dataset_is_never_opened(tmp_path):
    """A blend entry set to weight 0 (switched off, as when a source is withdrawn) takes no samples,
    so its shard is never read: it may be absent, and it builds no indices of its own."""
    kept = make_shard(tmp_path / "kept", 0)
    blended = build_blended_samples([[1.0, kept], [0.0, str(tmp_path / "withdrawn")]], 8, 50, 0,
                                    cache_dir=str(tmp_path / "cache"))
    assert blended.datasets[1] is None and blended.dataset_index.tolist() == [0] * 50
    assert len(blended.datasets[0]) >= 50 and blended[49].tolist() == blended.datasets[0][49].tolist()
    # listed first, its folder did not hold the cache either (planted: the first entry's folder, made for it)
    build_blended_samples([[0.0, str(tmp_path / "gone" / "withdrawn")], [1.0, kept]], 8, 50, 0)
    assert not (tmp_path / "gone").exists()


@pytest.mark.parametrize("compiled", [True, False])
def test_a_zero_weight_dataset_listed_first_is_never_drawn(tmp_path, compiled, monkeypatch):
    """At sample 1 every dataset's error is 0, and the rule's tie went to the first dataset, so a
    weight-0 entry listed first took one sample: its shard was opened (absent, the run stopped) and
    trained on. Neither loop may draw it, and the other datasets keep their shares."""
    import data_pipeline.blend as blend

    if not compiled:
        monkeypatch.setattr(blend, "compiled_blend", lambda: None)
    for weights in ([0.0, 1.0], [0.0, 0.5, 0.5], [0.0, 0.0, 3.0, 1.0]):
        counts = np.bincount(greedy_blend(weights, 1000)[0], minlength=len(weights))
        assert counts[np.asarray(weights) == 0].sum() == 0, weights
    assert greedy_blend([0.0, 3.0, 1.0], 1000)[0].tolist() == (greedy_blend([3.0, 1.0], 1000)[0] + 1).tolist()
    kept = make_shard(tmp_path / "kept", 0)
    blended = blend.build_blended_samples([[0.0, str(tmp_path / "withdrawn")], [1.0, kept]], 8, 50, 0,
                                          cache_dir=str(tmp_path / "cache"))
    assert blended.datasets[0] is None and blended.dataset_index.tolist() == [1] * 50


def test_each_dataset_is_built_for_exactly_the_samples_the_blend_takes(tmp_path):
    """Two shards of 10 documents of 10 tokens give 99 // 9 = 11 samples of 9+1 tokens an epoch; a
    blend of 22 samples at equal weights takes 11 from each, so each is one epoch, every document
    once. (Planted: one sample more asked of each dataset, which took a second epoch and reshuffled
    every sample with it; the per-sample checks passed, comparing against indices built the same way.)"""
    prefixes = []
    for i in range(2):
        with IndexedDatasetWriter(str(tmp_path / f"d{i}"), np.uint16) as w:
            for doc in range(10):
                w.add_document(np.arange(10) + 100 * doc + 1000 * i)
        prefixes.append(str(tmp_path / f"d{i}"))
    blended = build_blended_samples([[0.5, prefixes[0]], [0.5, prefixes[1]]], 9, 22, 0, cache_dir=str(tmp_path / "c"))
    for dataset in blended.datasets:
        assert len(dataset) == 11 and sorted(dataset.document_index.tolist()) == list(range(10))
