"""Decontamination by the GPT-3 / MT-NLG rules, on hand-made documents: a 13-gram match is removed with
200 characters on each side, short pieces go, a document split more than 10 times goes, and n-grams
common in the training corpus are ignored."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data_pipeline.curate.config import build_config
from data_pipeline.curate.decontaminate import DecontaminateConfig, NgramKeys, cut
from data_pipeline.curate.pipeline import run_pipeline

TASK = "The quick brown fox jumps over the lazy dog near the quiet river bank at dawn"  # 16 words
FILLER = " ".join(f"word{i}" for i in range(200))  # 200 distinct words, ~1.5k characters


def run(tmp_path, docs: list[str], **options) -> tuple[list[dict], dict]:
    corpus, task = tmp_path / "docs.jsonl", tmp_path / "qa.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(docs)))
    task.write_text(json.dumps({"text": TASK}) + "\n")
    raw = {"input": {"paths": [str(corpus)]}, "output": {"dir": str(tmp_path / "out")}, "stages": ["decontaminate"],
           "decontaminate": {"tasks": [str(task)], **options}}
    result = run_pipeline(build_config(raw), log=lambda s: None)
    records = [json.loads(line) for s in result["shards"] for line in open(s)]
    return records, result["stages"][-1]


def test_a_match_is_cut_out_with_200_characters_each_side(tmp_path):
    doc = f"{FILLER} {TASK.upper()}, {FILLER}"  # case and punctuation do not hide a match
    records, stats = run(tmp_path, [doc])
    start = doc.index(TASK.upper())
    assert [r["id"] for r in records] == ["d0#0", "d0#1"]
    assert records[0]["text"] == doc[:start - 200].strip()
    assert records[1]["text"] == doc[start + len(TASK) + 200:].strip()
    assert stats["hits"] == {"qa": 4} and stats["docs_out"] == 2  # 16 words: four 13-grams


def test_pieces_under_200_characters_are_dropped(tmp_path):
    records, stats = run(tmp_path, [f"short intro {TASK} {FILLER}", f"{TASK}"])
    assert [r["id"] for r in records] == ["d0"]  # one piece left: it keeps the id
    assert records[0]["text"].startswith("word") and TASK not in records[0]["text"]
    assert stats["dropped"] == {"contaminated": 1}


def test_a_document_split_more_than_10_times_is_dropped():
    cfg = DecontaminateConfig()
    ngrams = NgramKeys(13)
    for matches, kept in ((10, True), (11, False)):
        text = f" {FILLER} ".join([TASK] * matches) + f" {FILLER}"
        hashes, spans = ngrams.words(text)
        keys = ngrams.keys(hashes)
        task_keys = ngrams.keys(ngrams.words(TASK)[0])
        pieces = cut(text, spans, np.flatnonzero(np.isin(keys, task_keys)), cfg)
        assert (pieces is not None) == kept


def test_ngrams_in_10_or_more_training_documents_are_ignored(tmp_path):
    common = [f"{FILLER} {TASK} {FILLER}"] * 10
    records, stats = run(tmp_path, common)
    assert len(records) == 10 and stats["ignored_frequent_ngrams"] == 4 and stats["hits"] == {"qa": 0}
    (tmp_path / "nine").mkdir()
    records, stats = run(tmp_path / "nine", common[:9])
    assert len(records) == 18 and stats["hits"] == {"qa": 36}


def test_no_task_files_is_one_line(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(json.dumps({"text": FILLER}) + "\n")
    raw = {"input": {"paths": [str(corpus)]}, "output": {"dir": str(tmp_path / "out")}, "stages": ["decontaminate"]}
    with pytest.raises(ValueError, match="decontaminate.tasks: no task files"):
        run_pipeline(build_config(raw), log=lambda s: None)
