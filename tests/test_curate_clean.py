"""The clean stage's text repair gives exactly ftfy.fix_text's result while calling ftfy only on the
lines it could change, and whitespace normalisation does what its docstring says."""

from __future__ import annotations

import json

import pytest

ftfy = pytest.importorskip("ftfy", reason="ftfy is not installed (a curation dependency)")

from data_pipeline.curate.clean import (CleanConfig, clean_shard, count_words, drop_reason, normalise_whitespace,
                                        repair_unicode)
from data_pipeline.curate.demo import stdlib_prose

PLAIN = "A plain ASCII line with <b>no</b> entity, (brackets) and 'quotes'.\n"
CASES = {
    "plain": PLAIN * 3,
    "mojibake amid plain lines": PLAIN + "The caf\u00c3\u00a9 is open \u00e2\u0080\u0094 come in.\n" + PLAIN,
    "entity before any tag": "Fish &amp; chips&hellip;\n" + PLAIN + "Salt &amp; vinegar\n",
    "entity after a tag line": "plain\n" + PLAIN + "Salt &amp; vinegar &lt;3\n",
    "tag and entity on one line": "x <i>a</i> &amp; b\nc &amp; d\n",
    "controls and escapes": "bell\x07 here\nnull\x00 and \x1b[31mred\x1b[0m\nform\x0cfeed\n",
    "line breaks": "one\r\ntwo\rthree\u2028four\x85five",
    "widths, quotes, ligatures": "\uff2c\uff2f\uff35\uff24 \u201cquoted\u201d \u2018it\u2019s\u2019 \ufb02ow\n" + PLAIN,
    "c1 and nfc": "Fran\u0063\u0327ais \x80 text\ntab\there\n",
    "surrogates": "emoji \ud83d\ude00 pair\n" + PLAIN,
    "no final newline": PLAIN + "last &amp; line",
    "empty": "",
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_repair_is_ftfy_fix_text(name):
    assert repair_unicode(CASES[name]) == ftfy.fix_text(CASES[name])


def test_repair_is_ftfy_fix_text_on_real_prose():
    for text in stdlib_prose(max_docs=200):
        assert repair_unicode(text) == ftfy.fix_text(text)


def test_normalise_whitespace():
    text = "\n  a \t b\u00a0\u00a0c\u3000d  \r\n\r\n \r\n\r\ne\u2003f \n\n\n\n  g  \n"
    assert normalise_whitespace(text) == "  a b c d\n\ne f\n\n  g"
    assert normalise_whitespace("x y") == "x y" and normalise_whitespace("x\u00a0y\tz") == "x y z"
    assert normalise_whitespace("a\n\n\nb\n\nc") == "a\n\nb\n\nc"  # three newlines are already too many


def test_each_filter_drops_at_its_threshold_and_not_before():
    """The stage's four rules, each just inside and just past its limit (words, symbols, repeated
    lines), so a rule switched off or with its comparison turned round fails here."""
    cfg = CleanConfig(min_words=5, max_words=20, max_symbol_ratio=0.25, max_repeated_line_ratio=0.3)
    words = lambda n: " ".join(f"w{i}" for i in range(n))  # noqa: E731
    assert drop_reason(words(4), cfg) == "too few words" and drop_reason(words(5), cfg) is None
    assert drop_reason(words(21), cfg) == "too many words" and drop_reason(words(20), cfg) is None
    text = "a b c d e"  # 9 characters: 3 symbols make exactly a quarter of 12 (kept), 4 more than one of 13
    assert drop_reason(text + "!!!", cfg) is None and drop_reason(text + "!!!!", cfg) == "symbol ratio"
    lines = [words(5) + f" line{i}" for i in range(10)]
    three = "\n".join(lines[:7] + lines[:3])  # 3 of 10 lines repeat an earlier one: 0.3, not over it
    four = "\n".join(lines[:6] + lines[:4])
    assert drop_reason(three, CleanConfig(min_words=5, max_words=1000)) is None
    assert drop_reason(four, CleanConfig(min_words=5, max_words=1000)) == "repeated lines"


def test_combining_marks_are_parts_of_words_and_unspaced_scripts_count_by_character():
    """The vowel signs and viramas of Devanagari, Tamil and Bengali (categories Mn and Mc) are parts of
    letters: counted as symbols, ordinary prose (0.30-0.38 of its characters) was dropped as "symbol
    ratio" by default, a whole language lost; they also split every word in two. Han and kana are
    written without spaces, so each counts as a word, not each clause. (Planted: marks left out of
    the word characters; Han counted by runs.)"""
    cfg = CleanConfig(min_words=8)
    prose = {"hindi": "यह एक साधारण हिंदी वाक्य है जिसमें कई शब्द हैं और मात्राएँ भी हैं।",
             "tamil": "இது ஒரு சாதாரண தமிழ் வாக்கியம் இதில் பல சொற்கள் உள்ளன.",
             "bengali": "এটি একটি সাধারণ বাংলা বাক্য যেখানে অনেক শব্দ আছে।"}
    for name, text in prose.items():
        assert drop_reason(text, cfg) is None, name
        assert drop_reason(text, CleanConfig(min_words=len(text.split()) + 1)) == "too few words", name
    assert drop_reason(prose["hindi"], CleanConfig(min_words=len(prose["hindi"].split()))) is None
    chinese = "今天天气很好，我们去公园散步吧。"  # 14 characters in two clauses
    assert drop_reason(chinese, CleanConfig(min_words=14)) is None
    assert drop_reason(chinese, CleanConfig(min_words=15)) == "too few words"
    # a run of letters or digits stops at the first Han character: 在, 2023, 年, then one word a character
    dated = "在2023年发布了新版本abc的东西"
    assert count_words(dated) == 13 and count_words("2023年" * 40) == 80


def test_underscores_are_symbols_not_letters():
    """``\\w`` holds ``_``: a line of form blanks counted as words and passed, and 200 underscores
    weighed nothing in the symbol ratio where 200 dashes dropped the document. (Planted: ``_`` a
    letter in either count.)"""
    cfg = CleanConfig(min_words=5)
    assert count_words("____ ____ ____ ____ ____ ____") == 0 and count_words("snake_case_name") == 3
    assert drop_reason("____ ____ ____ ____ ____ ____", cfg) == "too few words"
    for junk in ("_" * 200, "-" * 200):
        assert drop_reason("one two three four five six " + junk, cfg) == "symbol ratio", junk


def test_indentation_is_kept():
    """Code and verse keep their lines' leading spaces and tabs (every line was stripped at both ends,
    flattening every program in the corpus); runs inside a line and blank lines' spaces still go."""
    code = "def f(x):\n    if x:\n\treturn  1   \n    return 2\n   \n  g  "
    assert normalise_whitespace(code) == "def f(x):\n    if x:\n\treturn 1\n    return 2\n\n  g"


def test_a_zero_width_space_is_no_space():
    """U+200B is a break hint inside a word (or between Thai words), not white space: it was made a
    space, splitting the word. (Planted: the space ranges up to U+200B.)"""
    for text in ("super\u200bcalifragilistic", "東京\u200b都", "ภาษา\u200bไทย"):
        assert normalise_whitespace(text) == text


def test_the_stage_writes_the_cleaned_text_and_counts_both_sizes(tmp_path):
    raw = "\ncaf\u00c3\u00a9   au  lait  "  # mojibake and loose spaces
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "0", "text": raw}) + "\n")
    stats = clean_shard(str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "text", CleanConfig(min_words=0))
    assert [json.loads(line)["text"] for line in open(tmp_path / "out.jsonl")] == ["caf\u00e9 au lait"]
    assert stats["bytes_in"] == len(raw.encode("utf-8")) and stats["bytes_out"] == len("caf\u00e9 au lait".encode())


def test_a_lone_carriage_return_is_a_line_break():
    assert normalise_whitespace("a\rb\r\r\r\rc") == "a\nb\n\nc"


def test_blank_lines_between_paragraphs_are_not_repeated_lines():
    """Only non-blank lines count towards the repeated-line share: prose of ten paragraphs has nine
    equal blank lines between them and is kept (planted: blank lines counted, 8 repeats of 19 lines)."""
    prose = "\n\n".join(" ".join(f"p{k}w{i}" for i in range(10)) for k in range(10))
    assert drop_reason(prose, CleanConfig(min_words=5)) is None


def test_fix_unicode_off_leaves_the_text_unrepaired(tmp_path):
    """clean.fix_unicode: false keeps what ftfy would change (mojibake, entities) and still
    normalises white space (planted: the option ignored, every text repaired, passed)."""
    from data_pipeline.curate.clean import clean_text

    raw = "caf\u00c3\u00a9 &amp;   au  lait  "
    assert clean_text(raw, CleanConfig(fix_unicode=False)) == "caf\u00c3\u00a9 &amp; au lait"
    assert clean_text(raw, CleanConfig()) == "caf\u00e9 & au lait"
