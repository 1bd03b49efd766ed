"""Decontamination by the GPT-3 / MT-NLG rules, on hand-made documents: a 13-gram match is removed with
200 characters on each side, short pieces go, a document split more than 10 times goes, and n-grams
common in the training corpus are ignored."""

from __future__ import annotations

import gzip
import json
import re

import numpy as np
import pytest

from data_pipeline.curate.clean import repair_unicode
from data_pipeline.curate.config import build_config
from data_pipeline.curate import decontaminate
from data_pipeline.curate.decontaminate import DecontaminateConfig, NgramKeys, _bmp_tables, cut
from data_pipeline.curate.pipeline import run_pipeline

TASK = "The quick brown fox jumps over the lazy dog near the quiet river bank at dawn"  # 16 words
FILLER = " ".join(f"word{i}" for i in range(200))  # 200 distinct words, ~1.5k characters


def run(tmp_path, docs: list[str], tasks: dict | None = None, shard_docs: int = 10_000,
        **options) -> tuple[list[dict], dict]:
    """Decontaminate ``docs`` against ``tasks`` (a file name under tmp_path -> its one text, gzipped
    where the name says so; qa.jsonl holding TASK by default)."""
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(docs)))
    for name, text in (tasks or {"qa.jsonl": TASK}).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        record = (json.dumps({"text": text}) + "\n").encode()
        (tmp_path / name).write_bytes(gzip.compress(record) if name.endswith(".gz") else record)
    raw = {"input": {"paths": [str(corpus)], "shard_docs": shard_docs}, "output": {"dir": str(tmp_path / "out")},
           "stages": ["decontaminate"],
           "decontaminate": {"tasks": [str(tmp_path / name) for name in (tasks or {"qa.jsonl": TASK})], **options}}
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
    assert stats["pieces"] == 2 and stats["task_texts_shorter_than_ngram"] == {"qa": 0}
    assert stats["ngram"] == 13  # the report's plot names it


def test_underscores_do_not_hide_a_match(tmp_path):
    """``_`` joined words as ``\\w`` does: markdown's ``_quick_`` and a ``snake_case`` join made words
    no task has, and the text passed whole. (Planted: ``_`` a word character.)"""
    italic = TASK.replace("quick", "_quick_").replace("lazy", "__lazy__")
    joined = TASK.replace("quick brown", "quick_brown")
    records, stats = run(tmp_path, [f"{FILLER} {italic} {FILLER}", f"{FILLER} {joined} {FILLER}"])
    assert [r["id"] for r in records] == ["d0#0", "d0#1", "d1#0", "d1#1"]
    assert stats["cut"] == 2


def test_pieces_under_200_characters_are_dropped(tmp_path):
    records, stats = run(tmp_path, [f"short intro {TASK} {FILLER}", f"{TASK}"])
    assert [r["id"] for r in records] == ["d0"]  # one piece left: it keeps the id
    assert records[0]["text"].startswith("word") and TASK not in records[0]["text"]
    assert stats["dropped"] == {"contaminated": 1}
    assert (stats["cut"], stats["pieces"]) == (1, 1) and stats["docs_out"] == stats["docs_in"] - 1 - 1 + 1


def test_a_document_split_more_than_10_times_is_dropped():
    cfg = DecontaminateConfig()
    ngrams = NgramKeys(13)
    for matches, kept in ((10, True), (11, False)):
        text = f" {FILLER} ".join([TASK] * matches) + f" {FILLER}"
        hashes, starts, ends, offsets = ngrams.words([text])
        keys, _, windows = ngrams.keys(hashes, offsets)
        task_keys = ngrams.keys(*ngrams.words([TASK])[::3])[0]
        pieces = cut(text, starts, ends, windows[np.isin(keys, task_keys)], cfg)
        assert (pieces is not None) == kept


def test_touching_removals_are_one_split_and_a_piece_of_min_piece_chars_is_kept():
    """(Found by planting bugs.) A removal that starts where the previous one ends joins it: no piece
    lies between, so it is no further split; a piece of exactly min_piece_chars stays."""
    cfg = DecontaminateConfig(ngram=1, margin=1, max_splits=1, min_piece_chars=5)
    text = "aa, bb hello"  # "aa" less its margin ends at 3, where "bb" less its margin starts
    _, starts, ends, _ = NgramKeys(1).words([text])
    assert cut(text, starts, ends, np.array([0, 1]), cfg) == ["hello"]


def test_min_piece_chars_0_keeps_every_piece_but_writes_no_empty_document():
    """A match at a document's start leaves nothing before it: at ``min_piece_chars`` 0 that empty
    piece was written as a document of its own."""
    cfg = DecontaminateConfig(ngram=1, margin=0, min_piece_chars=0)
    text = "leak rest of the document"
    _, starts, ends, _ = NgramKeys(1).words([text])
    assert cut(text, starts, ends, np.array([0]), cfg) == ["rest of the document"]
    assert cut(text, starts, ends, np.array([0, 4]), cfg) == ["rest of the"]  # at its end too


def test_every_word_of_an_ngram_is_in_its_key():
    """(Found by planting bugs.) Changing any one of the 13 words changes the key: a document sharing
    only 12 of them with a task is no match."""
    ngrams = NgramKeys(13)
    words = TASK.split()[:13]
    key = lambda ws: ngrams.keys(*ngrams.words([" ".join(ws)])[::3])[0].tolist()  # noqa: E731
    assert len(key(words)) == 1
    for i in range(13):
        assert key(words[:i] + ["zebra"] + words[i + 1:]) != key(words), i


def test_a_passage_quoted_10_times_in_one_document_is_still_cut(tmp_path):
    """The frequency rule counts documents, not occurrences: one page quoting a task passage ten
    times is one document, so its n-grams are not exempted (planted: occurrences counted, which
    left that page, and every other copy of the passage, in the corpus)."""
    doc = f" {FILLER} ".join([TASK] * 10) + f" {FILLER}"
    records, stats = run(tmp_path, [doc])
    assert stats["ignored_frequent_ngrams"] == 0 and stats["hits"] == {"qa": 40}
    assert all(TASK not in r["text"] for r in records) and len(records) > 1


def test_ngrams_in_10_or_more_training_documents_are_ignored(tmp_path):
    common = [f"{FILLER} {TASK} {FILLER}"] * 10
    records, stats = run(tmp_path, common)
    assert len(records) == 10 and stats["ignored_frequent_ngrams"] == 4 and stats["hits"] == {"qa": 0}
    (tmp_path / "nine").mkdir()
    records, stats = run(tmp_path / "nine", common[:9])
    assert len(records) == 18 and stats["hits"] == {"qa": 36}


def test_the_max_doc_freq_option_sets_how_common_an_ignored_ngram_is(tmp_path):
    """decontaminate.max_doc_freq reaches the frequency pass: at 3, a task passage in three documents
    is a common phrase and stays (planted: the pass kept the default 10, and cut all three, passed)."""
    records, stats = run(tmp_path, [f"{FILLER} {TASK} {FILLER}"] * 3, max_doc_freq=3)
    assert len(records) == 3 and stats["ignored_frequent_ngrams"] == 4 and stats["hits"] == {"qa": 0}


def test_no_task_files_is_one_line(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(json.dumps({"text": FILLER}) + "\n")
    raw = {"input": {"paths": [str(corpus)]}, "output": {"dir": str(tmp_path / "out")}, "stages": ["decontaminate"]}
    with pytest.raises(ValueError, match="decontaminate.tasks: no task files"):
        run_pipeline(build_config(raw), log=lambda s: None)


def test_task_files_with_nothing_to_find_are_named(tmp_path):
    """A task file whose texts are all shorter than the n-gram, or a parquet file of no rows (its
    columns alone passed for records), would leave the stage removing nothing without a word."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(json.dumps({"text": FILLER}) + "\n")
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "Who wrote Hamlet?"}) + "\n" + json.dumps({"text": ""}) + "\n")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "none.parquet")
    for task, message in ((short, r"short\.jsonl: no text of 13 or more words, .*; lower decontaminate\.ngram"),
                          (tmp_path / "none.parquet", r"none\.parquet holds no records")):
        raw = {"input": {"paths": [str(corpus)]}, "output": {"dir": str(tmp_path / "out")},
               "stages": ["decontaminate"], "decontaminate": {"tasks": [str(task)]}}
        with pytest.raises(ValueError, match=message):
            build_config(raw)


def test_the_word_table_is_res_word_class_but_underscore_and_the_combining_marks():
    import unicodedata

    is_word, _, invisible = _bmp_tables()
    assert is_word.tolist() == [re.fullmatch(r"[^\W_]", chr(c)) is not None or unicodedata.category(chr(c))[0] == "M"
                                for c in range(0x10000)]
    assert invisible.tolist() == [unicodedata.category(chr(c)) == "Cf" for c in range(0x10000)]


def test_indic_words_are_whole_and_greek_capitals_match_their_final_sigma():
    """A vowel sign or virama is part of its letter: counted as a break, every Hindi word fell in two
    and a 13-gram spanned half as many words. Lower-cased a character at a time, a capital word's
    last sigma was no final sigma, so a task in capitals never matched the same text in lower case.
    (Planted: the marks left out of the word table; the final sigma not folded.)"""
    hindi = "यह एक साधारण हिंदी वाक्य है जिसमें कई शब्द हैं"
    _, starts, ends, _ = NgramKeys(13).words([hindi])
    assert [hindi[a:b] for a, b in zip(starts.tolist(), ends.tolist())] == hindi.split()
    hashes, _, _, _ = NgramKeys(13).words(["ΕΛΛΑΔΟΣ ΟΔΟΣ", "ελλαδος οδος", "ελλαδοσ"])
    assert hashes[0] == hashes[2] == hashes[4] and hashes[1] == hashes[3]


def test_words_are_res_word_runs_but_underscore_and_compare_lower_cased():
    """Above the BMP too: Deseret's capitals and small letters are one word (planted: code points
    past 0xFFFF compared as written, which a test of caseless astral letters alone let through)."""
    texts = ["Hello, WORLD! hello world_2 ... Istanbul ISTANBUL listen silent", "",
             "Stra\u00dfe caf\u00e9 CAF\u00c9 na\u00efve",
             "emoji \U0001f600 ok \U0001d400\U0001d401 \U0001d7d9x \U00020000ab", "a", "  -- ",
             "\U00010400\U00010401 \U00010428\U00010429"]
    hashes, starts, ends, offsets = NgramKeys(13).words(texts)
    words = []
    for t, text in enumerate(texts):
        ours = list(zip(starts[offsets[t]:offsets[t + 1]].tolist(), ends[offsets[t]:offsets[t + 1]].tolist()))
        assert ours == [m.span() for m in re.finditer(r"[^\W_]+", text)], text
        words += [text[a:b] for a, b in ours]
    for i, u in enumerate(words):
        for j, v in enumerate(words):
            assert (hashes[i] == hashes[j]) == (u.lower() == v.lower()), (u, v)


def test_a_match_past_the_first_batch_is_cut_from_its_own_document(tmp_path, monkeypatch):
    """A shard longer than one batch of hashed text (1 MiB; here shrunk to about one document): a
    match in a later batch is found in, and cut from, its own document, with the same result as
    one batch (planted: hits numbered within their batch, not the shard, so the cut landed on the
    first documents)."""
    docs = [f"{FILLER} {i}" for i in range(6)]
    docs[4] = f"{FILLER} {TASK} {FILLER}"
    (tmp_path / "one").mkdir()
    (tmp_path / "many").mkdir()
    whole = run(tmp_path / "one", docs)
    monkeypatch.setattr(decontaminate, "BATCH_CHARS", 2000)
    batched = run(tmp_path / "many", docs)
    for _, stats in (whole, batched):
        stats.pop("seconds")
    assert batched == whole
    assert [r["id"] for r in whole[0]] == ["d0", "d1", "d2", "d3", "d4#0", "d4#1", "d5"]


def test_batches_give_each_texts_own_ngrams(monkeypatch):
    """However texts are batched, a text's n-grams are its own (none spans two texts), numbered by text."""
    texts = [f"{TASK} {i}" if i % 3 else "too short" for i in range(12)]
    ngrams = NgramKeys(13)
    alone = [ngrams.keys(*ngrams.words([t])[::3])[0] for t in texts]
    monkeypatch.setattr(decontaminate, "BATCH_CHARS", 200)  # several texts per batch, several batches
    found = [[] for _ in texts]
    batches = list(ngrams.batches(texts))
    for begin, keys, text, window in batches:
        for k, t, w in zip(keys.tolist(), text.tolist(), window.tolist()):
            found[begin + t].append((w, k))
    assert len(batches) > 2
    assert [[k for _, k in sorted(f)] for f in found] == [a.tolist() for a in alone]


OTHER = "seven purple elephants were dancing slowly under the pale moonlight beside an old stone mill"
THIRD = "nine silver kettles were whistling together in the crowded kitchen of the harbour inn"


def test_every_task_file_is_searched_and_counted(tmp_path):
    """Only the first task file searched, or a task without hits missing from the counts, went unseen:
    the n-grams of the others stayed in the training data."""
    records, stats = run(tmp_path, [f"{FILLER} {OTHER} {FILLER}"],
                         {"a.jsonl": TASK, "b.jsonl": OTHER, "c.jsonl": THIRD})
    assert stats["hits"] == {"a": 0, "b": 3, "c": 0}
    assert len(records) == 2 and all(OTHER not in r["text"] for r in records)


def test_an_ngram_of_several_tasks_is_a_hit_of_each(tmp_path):
    """Two benchmarks that quote one passage both leaked: the hit was credited to the first task file
    alone, and the report said the second had none. Hits of a task's own n-grams stay its own."""
    _, stats = run(tmp_path, [f"{FILLER} {TASK} {FILLER}", f"{FILLER} {OTHER} {FILLER}"],
                   {"a.jsonl": f"{OTHER} {TASK}", "b.jsonl": TASK, "c.jsonl": THIRD})
    assert stats["hits"] == {"a": 7, "b": 4, "c": 0}  # a: TASK's four 13-grams and OTHER's three


def test_task_files_of_one_name_keep_their_own_counts(tmp_path):
    """lambada/test.jsonl and hellaswag/test.jsonl were both 'test': one's hits replaced the other's."""
    _, stats = run(tmp_path, [f"{FILLER} {TASK} {FILLER}"],
                   {"lambada/test.jsonl": TASK, "hellaswag/test.jsonl": OTHER, "qa.jsonl": THIRD})
    assert stats["hits"] == {"lambada/test": 4, "hellaswag/test": 0, "qa": 0}
    assert decontaminate.task_names(["/x/a/t.jsonl", "/x/b/t.jsonl.gz", "/x/b/u.parquet"]) == ["a/t", "b/t", "u"]
    # folders are added until the names differ: two test files under x/ need the folder above it too
    assert decontaminate.task_names(["/r/a/x/test.jsonl", "/r/b/x/test.jsonl", "/r/c/qa.jsonl"]) == \
        ["a/x/test", "b/x/test", "qa"]
    # no folder tells apart two files of one folder and one name: they keep their extensions
    assert decontaminate.task_names(["/x/a/test.jsonl", "/x/a/test.parquet", "/x/b/test.jsonl"]) == \
        ["test.jsonl", "test.parquet", "test"]


def test_task_files_of_one_folder_and_name_keep_their_own_counts(tmp_path):
    """qa.jsonl and qa.jsonl.gz beside it were both named by their whole folder and 'qa': the second's
    count replaced the first's, and the report said its leak had no hits (planted: names by the
    stem alone, however many folders lead it)."""
    _, stats = run(tmp_path, [f"{FILLER} {TASK} {FILLER}"], {"qa.jsonl": TASK, "qa.jsonl.gz": OTHER})
    assert stats["hits"] == {"qa.jsonl": 4, "qa.jsonl.gz": 0}


def test_document_frequency_is_summed_over_every_shard(tmp_path):
    """A task n-gram in 10 documents is too common to be a leak, though no shard of 3 holds more
    than 3: counted per shard, every copy was cut."""
    records, stats = run(tmp_path, [f"{FILLER} {TASK} {FILLER}"] * 10, shard_docs=3)
    assert stats["ignored_frequent_ngrams"] == 4 and len(records) == 10


ACCENTED = "Le café où été né un garçon très âgé près du théâtre de la forêt"  # 15 words, accented


@pytest.mark.parametrize("task_form, doc_form", [("NFD", "NFC"), ("NFC", "NFD")])
def test_a_task_matches_in_either_unicode_form(tmp_path, task_form, doc_form):
    """Compared as written, a decomposed "é" (a letter and a combining mark) hashed unlike the
    precomposed one and the leak went unfound (0 hits, no warning)."""
    import unicodedata
    form = lambda f, text: unicodedata.normalize(f, text)  # noqa: E731
    doc = f"{FILLER} {form(doc_form, ACCENTED)} {FILLER}"
    records, stats = run(tmp_path, [doc], tasks={"qa.jsonl": form(task_form, ACCENTED)})
    assert stats["hits"] == {"qa": 3}  # 15 words: three 13-grams
    assert [r["id"] for r in records] == ["d0#0", "d0#1"]
    composed = unicodedata.normalize("NFC", doc)  # a cut document's pieces come from its composed form
    start = composed.index(form("NFC", ACCENTED))
    assert records[0]["text"] == composed[:start - 200].strip()
    assert records[1]["text"] == composed[start + len(form("NFC", ACCENTED)) + 200:].strip()


def test_the_ngram_option_sets_the_words_compared_in_every_pass(tmp_path):
    """decontaminate.ngram reaches the document pass as well as the tasks': a task of 8 words is one
    8-gram, found and cut with its margins (planted: the document pass kept comparing 13-grams,
    found nothing, and the leak stayed in)."""
    task = " ".join(OTHER.split()[:8])
    doc = f"{FILLER} {task} {FILLER}"
    records, stats = run(tmp_path, [doc], {"qa.jsonl": task}, ngram=8)
    assert stats["hits"] == {"qa": 1}
    start = doc.index(task)
    assert [r["text"] for r in records] == [doc[:start - 200].strip(), doc[start + len(task) + 200:].strip()]


@pytest.mark.parametrize("fix_unicode", [True, False])
def test_a_task_is_found_in_the_form_the_clean_stage_repairs_it_to(tmp_path, fix_unicode):
    """A passage copied into the corpus as it stands in the task file, with mojibake and a PDF ligature:
    the clean stage's repair changes those words in the corpus, and the task, compared as written,
    then matched no 13-gram (the leak kept, 0 hits). Both forms of the task are searched, so it is cut
    whether the corpus was repaired or not. (Planted: the task's repaired form left out.)"""
    task = "Le cafÃ© oÃ¹ Ã©tait nÃ© un garÃ§on trÃ¨s ï¬\x81er de la forÃªt et du thÃ©Ã¢tre au bord"
    doc = f"{FILLER} {task} {FILLER}"
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(json.dumps({"id": "d0", "text": doc}) + "\n")
    (tmp_path / "qa.jsonl").write_text(json.dumps({"text": task}) + "\n")
    raw = {"input": {"paths": [str(corpus)]}, "output": {"dir": str(tmp_path / "out")},
           "stages": ["clean", "decontaminate"], "clean": {"min_words": 1, "fix_unicode": fix_unicode},
           "decontaminate": {"tasks": [str(tmp_path / "qa.jsonl")]}}
    result = run_pipeline(build_config(raw), log=lambda s: None)
    records = [json.loads(line) for s in result["shards"] for line in open(s)]
    held = repair_unicode(task) if fix_unicode else task  # what the corpus holds after clean
    assert (held == task) is not fix_unicode
    assert result["stages"][-1]["hits"] == {"qa": len(NgramKeys(13).words([held])[0]) - 12}  # every 13-gram
    assert [r["id"] for r in records] == ["d0#0", "d0#1"]
    assert not any("caf" in r["text"] for r in records)


@pytest.mark.parametrize("mark", ["\u00ad", "\u200b", "\u200c", "\u200d", "\u2060", "\ufeff"])
@pytest.mark.parametrize("where", ["document", "task"])
def test_invisible_characters_inside_a_word_do_not_hide_a_match(tmp_path, mark, where):
    """A soft hyphen (web text's ``&shy;``, which the clean stage keeps), a zero-width space, joiner
    or non-joiner, a word joiner or a byte-order mark inside a word split it in two, so every 13-gram
    over that word missed: the leak passed whole (planted: format characters read as breaks). The
    cut still counts the document's characters as written."""
    hidden = TASK.replace("quiet", f"qui{mark}et").replace("lazy", f"la{mark}{mark}zy")
    doc_text, task_text = (hidden, TASK) if where == "document" else (TASK, hidden)
    doc = f"{FILLER} {doc_text} {FILLER}"
    records, stats = run(tmp_path, [doc], tasks={"qa.jsonl": task_text})
    assert stats["hits"] == {"qa": 4}, stats
    start = doc.index(doc_text)
    assert [r["text"] for r in records] == [doc[:start - 200].strip(), doc[start + len(doc_text) + 200:].strip()]


def test_a_word_read_through_invisible_characters_keeps_its_place_in_the_text():
    text = "\u00adsoft\u00adhyphen\u200b and\u2060 \u200b\u200bmore"
    _, starts, ends, _ = NgramKeys(13).words([text, "next"])
    assert [text[a:b] for a, b in zip(starts.tolist()[:3], ends.tolist()[:3])] == [
        "soft\u00adhyphen", "and", "more"]
    assert starts.tolist()[3] == 0 and ends.tolist()[3] == 4  # the next text's word, in its own places
