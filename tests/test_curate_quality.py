"""Quality stage: the Pareto keep rate against its closed form, draws that depend only on the document
id, and a fastText classifier trained by `megazero curate train-quality`."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest

from data_pipeline.curate.quality import (_HEADER, FASTTEXT_BUCKETS, FASTTEXT_MAGIC, MIN_BUCKETS, QualityConfig,
                                          _check_dictionary_fits, _one_line, keep_probability, load_model,
                                          pareto_keep, quality_shard, scores, train_quality)
from megazero.cli import main
from tests.curation import train_quality_model


@pytest.mark.parametrize("alpha", [3.0, 1.5])
def test_pareto_keep_rate_matches_the_closed_form(alpha):
    rng = np.random.default_rng(0)
    s = rng.beta(2, 2, 20_000)  # a fixed score distribution
    kept = np.array([pareto_keep(f"doc-{i}", x, alpha, seed=0) for i, x in enumerate(s)])
    expected = keep_probability(s, alpha)
    # overall and within score bins, within 4 binomial standard deviations
    assert abs(kept.mean() - expected.mean()) < 4 * np.sqrt(expected.mean() / len(s))
    for lo in np.arange(0, 1, 0.25):
        sel = (s >= lo) & (s < lo + 0.25)
        p = expected[sel].mean()
        assert abs(kept[sel].mean() - p) < 4 * np.sqrt(p * (1 - p) / sel.sum()) + 1e-3
    assert keep_probability(1.0, 3.0) == 1.0 and keep_probability(0.0, 3.0) == 0.125


def test_the_draw_depends_on_the_id_and_seed_only():
    first = [pareto_keep(f"doc-{i}", 0.5, 3.0, seed=7) for i in range(200)]
    assert first == [pareto_keep(f"doc-{i}", 0.5, 3.0, seed=7) for i in range(200)]
    assert first != [pareto_keep(f"doc-{i}", 0.5, 3.0, seed=8) for i in range(200)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    good = "the committee published a careful report on river water quality and its history".split()
    bad = "click buy now free win casino cheap pills lol omg subscribe".split()
    return train_quality_model(tmp_path_factory.mktemp("quality"), good, bad, docs=200, epoch=10)


def test_train_quality_separates_the_classes(trained, capsys):
    model = load_model(trained)
    s = scores(model, ["a careful report on the river and its water", "free casino pills, click now lol"])
    assert s[0] > 0.9 and s[1] < 0.1
    assert model.f.getArgs().bucket == MIN_BUCKETS  # the rows asked for reach fastText (planted: dropped)


def test_the_stage_keeps_good_documents_at_the_high_scores_rate(trained, tmp_path):
    """The stage scores each document and keeps it at the rate its score gives: 300 good and 300
    junk documents keep at about (2 - s)^-3 each, nearly all the good and about an eighth of the
    junk (planted: the score turned round, which keeps the junk and drops the good)."""
    good = [f"a careful report on the river and its water, part {i}" for i in range(300)]
    bad = [f"free casino pills, click now lol, offer {i}" for i in range(300)]
    shard = tmp_path / "in.jsonl"
    shard.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(good + bad)))
    stats = quality_shard(str(shard), str(tmp_path / "out.jsonl"), "text", QualityConfig(model=trained))
    kept = {json.loads(line)["id"] for line in open(tmp_path / "out.jsonl")}
    good_rate = sum(f"d{i}" in kept for i in range(300)) / 300
    bad_rate = sum(f"d{i}" in kept for i in range(300, 600)) / 300
    assert good_rate > 0.9 and bad_rate < 0.25, (good_rate, bad_rate)
    assert stats["docs_out"] == len(kept) and stats["dropped"] == {"pareto sample": 600 - len(kept)}


def test_train_quality_reports_held_out_accuracy(tmp_path, capsys):
    hq, lq = tmp_path / "hq.jsonl", tmp_path / "lq.jsonl"
    hq.write_text("".join(json.dumps({"text": f"careful river report {i}"}) + "\n" for i in range(30)))
    lq.write_text("".join(json.dumps({"text": f"cheap casino pills {i}"}) + "\n" for i in range(30)))
    assert main(["curate", "train-quality", "--hq", str(hq), "--lq", str(lq), "--output",
                 str(tmp_path / "m.bin")]) == 0
    assert "held-out accuracy 1.000 on 6" in capsys.readouterr().out
    assert load_model(str(tmp_path / "m.bin")).f.getArgs().bucket == FASTTEXT_BUCKETS == 2_000_000  # fastText's


def test_train_quality_without_documents_is_one_line(tmp_path, capsys):
    empty, other = tmp_path / "empty.jsonl", tmp_path / "other.jsonl"
    empty.write_text("")
    other.write_text("")
    assert main(["curate", "train-quality", "--hq", str(empty), "--lq", str(other), "--output",
                 str(tmp_path / "m.bin")]) == 2
    assert "--hq: no documents in" in capsys.readouterr().err


@pytest.mark.parametrize("flags, said", [
    (["--hq", "hq.jsonl", "--lq", "./hq.jsonl"], "--lq ./hq.jsonl is listed twice (also as --hq hq.jsonl)"),
    (["--hq", "hq.jsonl", "hq.jsonl", "--lq", "lq.jsonl"], "--hq hq.jsonl is listed twice;"),
], ids=["hq-as-lq", "hq-twice"])
def test_train_quality_refuses_a_file_listed_twice(tmp_path, capsys, monkeypatch, flags, said):
    """The same file as --hq and --lq trained a classifier of nothing (accuracy 0.4, reported without a
    word); a file listed twice put its documents in both the training and held-out rows (accuracy 1.0)."""
    monkeypatch.chdir(tmp_path)
    for name in ("hq.jsonl", "lq.jsonl"):
        (tmp_path / name).write_text(json.dumps({"text": "a document"}) + "\n")
    assert main(["curate", "train-quality", *flags, "--output", "m.bin"]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "m.bin").exists()


@pytest.mark.parametrize("output, said", [
    ("", "--output: an empty path names no model file (it would be read as the current directory); give a path "
     "such as quality.bin"),
    ("new/", "--output new/: names a folder; give a file path inside it, e.g. new/quality.bin"),
])
def test_train_quality_refuses_an_output_that_names_no_file_before_training(tmp_path, capsys, monkeypatch,
                                                                            output, said):
    """Both trained the model, then failed to rename it into place, blaming the temporary file.
    (Planted: no check: the missing inputs were named instead, as the first thing read.)"""
    from megazero.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["curate", "train-quality", "--hq", "a.jsonl", "--lq", "b.jsonl", "--output", output]) == 2
    assert capsys.readouterr().err.strip() == f"megazero curate: error: {said}"
    assert list(tmp_path.iterdir()) == []


def test_train_quality_refuses_zero_epochs_before_training(tmp_path, capsys):
    """``--epoch 0`` saved an untrained 512 MB model that scored every document 0.5."""
    from megazero.cli import main

    assert main(["curate", "train-quality", "--hq", "a.jsonl", "--lq", "b.jsonl", "--output",
                 str(tmp_path / "q.bin"), "--epoch", "0"]) == 2
    assert "--epoch: must be 1 or more, got 0" in capsys.readouterr().err
    assert not (tmp_path / "q.bin").exists()


def test_fewer_bigram_rows_than_fasttext_writes_are_refused_before_training(tmp_path):
    """Under 2**18 rows fastText's table came from reused heap memory, which it reads before writing:
    training went to NaN in most runs after NaN-filled arrays were freed (planted: the floor removed)."""
    for name, words in (("hq", "careful river report"), ("lq", "cheap casino pills")):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"{words} {i}"}) + "\n" for i in range(20)))
    with pytest.raises(ValueError, match=rf"bucket: {MIN_BUCKETS - 1} word-bigram rows, fewer than {MIN_BUCKETS}"):
        train_quality([str(tmp_path / "hq.jsonl")], [str(tmp_path / "lq.jsonl")], str(tmp_path / "m.bin"),
                      epoch=1, bucket=MIN_BUCKETS - 1)
    assert not (tmp_path / "m.bin").exists()


@pytest.mark.parametrize("keep", [1000, 300_000, -4096, 8, 60, 85])
def test_a_truncated_model_is_refused(trained, tmp_path, keep):
    """fastText loads a file cut short without a word: cut inside its matrices, every document scored
    about 0.5; cut inside its dictionary, the load read on forever; cut inside its header, it read no
    labels or failed to allocate. All are refused by size first (planted: the matrices' check
    skipped, the last cut loads)."""
    data = open(trained, "rb").read()
    cut = tmp_path / "cut.bin"
    cut.write_bytes(data[:keep])
    with pytest.raises(ValueError, match=r"quality.model: .*cut\.bin is truncated \(\d+ bytes where its header implies "
                                         r"at least \d+\)"):
        load_model(str(cut))


@pytest.mark.parametrize("raised,said", [(RuntimeError("Unknown loss"), "is a damaged fastText model; copy it again"),
                                         (MemoryError("std::bad_alloc"), "does not fit in memory here: it is damaged")])
def test_a_model_whose_header_fasttext_cannot_use_is_one_error(tmp_path, monkeypatch, raised, said):
    """fastText's magic and a whole header it cannot use: fastText raises a RuntimeError (an unknown
    loss) or fails to allocate (dimensions read past the end), which would reach the user as a
    traceback. Which one a given file meets depends on memory fastText leaves unset, so fastText's
    load is made to raise each here; an allocation that fails may also be a model too large for the
    machine, which the message allows."""
    import fasttext

    def load(path):
        raise raised

    monkeypatch.setattr(fasttext, "load_model", load)
    damaged = tmp_path / "damaged.bin"
    damaged.write_bytes(struct.pack("<ii", FASTTEXT_MAGIC, 12) + bytes(_HEADER.size - 8))
    with pytest.raises(ValueError, match=rf"quality.model: .*damaged\.bin {said}"):
        load_model(str(damaged))


def _scored_shard(tmp_path, monkeypatch, score: float) -> str:
    """A shard of 200 short documents d0, d1, ..., and the stage's classifier replaced by one that
    gives every document P(hq) = ``score``."""
    from data_pipeline.curate import quality

    class Constant:
        def predict(self, texts, k):
            return [[quality.HQ, quality.LQ]] * len(texts), [[score, 1.0 - score]] * len(texts)

    monkeypatch.setattr(quality, "load_model", lambda path: Constant())
    shard = tmp_path / "in.jsonl"
    shard.write_text("".join(json.dumps({"id": f"d{i}", "text": f"t {i}"}) + "\n" for i in range(200)))
    return str(shard)


def test_the_kept_histogram_counts_kept_documents_only(tmp_path, monkeypatch):
    shard = _scored_shard(tmp_path, monkeypatch, 0.05)  # the Pareto draw keeps few
    stats = quality_shard(shard, str(tmp_path / "out.jsonl"), "text", QualityConfig(model="m"))
    assert sum(stats["kept_histogram"]) == stats["docs_out"] < 200 == sum(stats["score_histogram"])


@pytest.mark.parametrize("alpha", [1.0, 3.0])
def test_the_stage_draws_with_the_configured_alpha_and_seed(tmp_path, monkeypatch, alpha):
    """quality.alpha and quality.seed reach each document's draw: the stage keeps exactly the ids the
    rule keeps with them, about half at alpha 1 and an eighth at 3 for a score near 0 (planted: the
    stage drawing at MT-NLG's alpha 3 whatever was set, passed)."""
    shard = _scored_shard(tmp_path, monkeypatch, 0.05)
    quality_shard(shard, str(tmp_path / "out.jsonl"), "text", QualityConfig(model="m", alpha=alpha, seed=5))
    kept = [json.loads(line)["id"] for line in open(tmp_path / "out.jsonl")]
    assert kept == [f"d{i}" for i in range(200) if pareto_keep(f"d{i}", 0.05, alpha, seed=5)]
    assert abs(len(kept) / 200 - 1.95 ** -alpha) < 0.1


def test_a_retrained_model_makes_the_finished_stage_stale(trained, tmp_path):
    import os
    import shutil

    from data_pipeline.curate.config import build_config
    from data_pipeline.curate.pipeline import run_pipeline

    model = shutil.copy(trained, tmp_path / "model.bin")
    (tmp_path / "raw.jsonl").write_text("".join(json.dumps({"text": f"a careful report {i}"}) + "\n" for i in range(10)))
    raw = {"input": {"paths": [str(tmp_path / "raw.jsonl")]}, "output": {"dir": str(tmp_path / "out")},
           "stages": ["quality"], "quality": {"model": str(model)}}
    run_pipeline(build_config(raw), log=lambda s: None)
    os.utime(model, ns=(1, 1))  # retrained in place
    with pytest.raises(ValueError, match=r"01-quality was made with other settings \(files differ\)"):
        run_pipeline(build_config(raw), log=lambda s: None)


def test_train_quality_names_a_bad_record_without_a_flag_it_does_not_have(tmp_path, capsys):
    """Training data is read strictly, always: the error named `--strict`, which this command lacks."""
    hq, lq = tmp_path / "hq.jsonl", tmp_path / "lq.jsonl"
    hq.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": 3}) + "\n")
    lq.write_text(json.dumps({"text": "cheap"}) + "\n")
    assert main(["curate", "train-quality", "--hq", str(hq), "--lq", str(lq), "--output", str(tmp_path / "m.bin")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{hq}:2: field 'text' is a number, not a string (the classifier trains on clean records only: fix or " \
           "remove it)" in err and "--strict" not in err, err


def _labelled_model(path, vocab: dict) -> str:
    """A small fastText model of the labels ``vocab`` names, each trained on its words."""
    import fasttext

    rng = np.random.default_rng(0)
    with open(f"{path}.txt", "w") as f:
        for _ in range(200):
            for label, words in vocab.items():
                f.write(f"__label__{label} " + " ".join(rng.choice(words.split(), 20)) + "\n")
    fasttext.train_supervised(input=f"{path}.txt", wordNgrams=2, epoch=5, dim=64, lr=0.5, thread=1,
                              seed=0, verbose=0, bucket=MIN_BUCKETS).save_model(str(path))
    return str(path)


def test_a_model_of_more_labels_scores_p_hq(tmp_path):
    """Only the top two labels were asked for: a document of a third class (code, say) left hq out
    of them and scored 1 - P(lq), near 1, so it was always kept."""
    vocab = {"hq": "river report careful history committee", "lq": "casino pills click buy lol",
             "code": "def return import class lambda"}
    model = load_model(_labelled_model(tmp_path / "three.bin", vocab))
    [s] = scores(model, ["def return import class lambda def"])
    labels, probs = model.predict("def return import class lambda def", k=-1)
    assert s == pytest.approx(dict(zip(labels, probs))["__label__hq"]) and s < 0.1


def test_a_model_without_the_hq_label_is_refused(tmp_path):
    """A fastText model of other labels scores every document P(hq) = 0, so the stage would keep an
    eighth of the corpus at random: refused by name (planted: the label check dropped, passed)."""
    path = _labelled_model(tmp_path / "good_bad.bin", {"good": "river report careful", "bad": "casino pills lol"})
    with pytest.raises(ValueError, match=r"quality\.model: .*good_bad\.bin has labels \['__label__\w+', "
                                         r"'__label__\w+'\], not __label__hq; train it with `megazero curate"):
        load_model(path)


def test_each_draw_is_the_documented_pareto_of_the_seed_and_the_ids_hash():
    """A document's draw is numpy's Pareto(alpha) from a generator seeded by [seed, the 64-bit
    BLAKE2b of its id read little-endian], kept when it exceeds 1 - score, so a corpus curated again
    keeps the documents it kept before (planted: the seed and the id's hash swapped, which keeps
    another set at the same rate). A score just above the threshold the draw sets keeps, just below drops."""
    checked = 0
    for i in range(40):
        doc_id = f"doc-{i}"
        key = int.from_bytes(hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8).digest(), "little")
        draw = np.random.default_rng([7, key]).pareto(3.0)
        if draw < 0.99:  # a threshold some score in [0, 1] meets
            checked += 1
            assert pareto_keep(doc_id, 1.0 - draw + 1e-9, 3.0, seed=7), doc_id
            assert not pareto_keep(doc_id, 1.0 - draw - 1e-9, 3.0, seed=7), doc_id
    assert checked >= 20


def test_copies_of_one_text_are_drawn_each_by_its_own_id(trained, tmp_path):
    """The stage's draw is keyed by the document id, not its text: 200 copies of one low-scoring text
    keep exactly the ids the rule keeps at that score, about an eighth of them (planted: the text as
    the key, which keeps every copy or none)."""
    text = "free casino pills, click now lol"
    shard = tmp_path / "in.jsonl"
    shard.write_text("".join(json.dumps({"id": f"d{i}", "text": text}) + "\n" for i in range(200)))
    quality_shard(str(shard), str(tmp_path / "out.jsonl"), "text", QualityConfig(model=trained, seed=3))
    [score] = scores(load_model(trained), [text])
    expected = [f"d{i}" for i in range(200) if pareto_keep(f"d{i}", float(score), 3.0, seed=3)]
    assert [json.loads(line)["id"] for line in open(tmp_path / "out.jsonl")] == expected
    assert 0 < len(expected) < 100


def test_train_quality_holds_out_a_tenth_from_ten_documents_on(tmp_path, capsys):
    """Ten documents hold one out for the accuracy; nine hold none, and the accuracy is not a number."""
    for total, said in ((10, "on 1;"), (9, "accuracy nan on 0;")):
        hq, lq = tmp_path / f"hq{total}.jsonl", tmp_path / f"lq{total}.jsonl"
        hq.write_text("".join(json.dumps({"text": f"careful river report {i}"}) + "\n" for i in range(5)))
        lq.write_text("".join(json.dumps({"text": f"cheap casino pills {i}"}) + "\n" for i in range(total - 5)))
        assert main(["curate", "train-quality", "--hq", str(hq), "--lq", str(lq), "--output",
                     str(tmp_path / f"m{total}.bin")]) == 0
        assert said in capsys.readouterr().out


def test_a_model_cut_anywhere_inside_its_dictionary_is_refused(trained, tmp_path):
    """fastText's load never returns on a file cut inside its dictionary (it reads a word's characters
    on past the end). A bound of 11 bytes an entry let through the cuts past it, inside the longer
    words; every cut from the header's end to the dictionary's is refused now, and the whole
    dictionary is not. The dictionary's end comes from fastText's own word list: each entry is the
    word, a NUL, its count (8 bytes) and its type (1 byte). The check is called alone here, since
    fastText would hang on a cut it let through."""
    import fasttext

    model = fasttext.load_model(trained)
    end = _HEADER.size + sum(len(w.encode("utf-8")) + 10 for w in model.get_words() + model.get_labels())
    data = open(trained, "rb").read()
    cut = tmp_path / "cut.bin"
    for keep in range(_HEADER.size, end):
        cut.write_bytes(data[:keep])
        with pytest.raises(ValueError, match=rf"cut\.bin is truncated \({keep} bytes where its header implies"):
            _check_dictionary_fits(str(cut))
    cut.write_bytes(data[:end])
    _check_dictionary_fits(str(cut))


def test_a_damaged_entry_count_is_refused_without_walking_the_file(trained, tmp_path):
    """A header claiming 2^31 - 1 dictionary entries cannot fit any file (11 bytes an entry at the
    least): it is refused at once, naming the size the count implies, not after a walk through every
    entry the file holds, here 1.5 million of them (planted: the bound dropped, so only the walk, a
    second or more, refused it)."""
    import time

    with open(trained, "rb") as f:
        fields = list(_HEADER.unpack(f.read(_HEADER.size)))
    fields[15] = 2**31 - 1
    damaged = tmp_path / "damaged.bin"
    damaged.write_bytes(_HEADER.pack(*fields) + (b"a\0" + bytes(9)) * 1_500_000)
    size = damaged.stat().st_size
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"damaged\.bin is truncated \({size} bytes where its header implies at "
                                         rf"least {_HEADER.size + 11 * (2**31 - 1)}\)"):
        _check_dictionary_fits(str(damaged))
    assert time.perf_counter() - start < 0.3


def test_held_out_documents_are_left_out_of_training_and_chosen_by_the_seed(tmp_path, capsys):
    """Each document holds a word of its own: the words missing from the trained model's vocabulary
    are those of the held-out documents, exactly as many as reported (planted: every document
    trained on, which measures the accuracy on seen text), and the same --seed holds out the same
    ones, another seed others (planted: --seed not passed on, or the shuffle left unseeded)."""
    import fasttext

    own = [f"own{i}" for i in range(40)]
    for name, words, rows in (("hq", "careful river report", range(20)), ("lq", "cheap casino pills", range(20, 40))):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"{words} {own[i]}"}) + "\n" for i in rows))

    def held_out(output: str, seed: int) -> set:
        assert main(["curate", "train-quality", "--hq", str(tmp_path / "hq.jsonl"), "--lq", str(tmp_path / "lq.jsonl"),
                     "--output", str(tmp_path / output), "--epoch", "1", "--seed", str(seed)]) == 0
        assert " on 4;" in capsys.readouterr().out
        missing = set(own) - set(fasttext.load_model(str(tmp_path / output)).get_words())
        assert len(missing) == 4
        return missing

    first = held_out("a.bin", seed=5)
    assert held_out("b.bin", seed=5) == first != held_out("c.bin", seed=6)


def test_a_documents_label_words_are_text_not_labels(tmp_path):
    """fastText takes any word beginning ``__label__`` for a label: a document about fastText (or one
    written to game the filter) added labels in training, here a third, and its own words steered
    which labels it was trained as; in scoring they were taken out of its words."""
    hq, lq = tmp_path / "hq.jsonl", tmp_path / "lq.jsonl"
    words = {"hq": "the committee published a careful report on river water quality", "lq": "click buy now cheap pills"}
    for path, kind, extra in ((hq, "hq", " __label__lq"), (lq, "lq", " __label__spam")):
        path.write_text("".join(json.dumps({"text": words[kind] + (extra if i % 4 == 0 else "")}) + "\n"
                                for i in range(40)))
    train_quality([str(hq)], [str(lq)], str(tmp_path / "m.bin"), bucket=MIN_BUCKETS, epoch=5)
    assert sorted(load_model(str(tmp_path / "m.bin")).get_labels()) == ["__label__hq", "__label__lq"]
    assert _one_line("a\0__label__zz  b\n__label__hq") == "a label__zz b label__hq"  # fastText splits at NUL


def test_without_fasttext_the_quality_stage_says_what_to_install(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_fasttext(name, *args, **kwargs):
        if name == "fasttext":
            raise ImportError("No module named 'fasttext'")
        return real(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_fasttext)
    with pytest.raises(ImportError, match=r"^the quality stage needs fastText: pip install fasttext-numpy2$"):
        load_model(__file__)
