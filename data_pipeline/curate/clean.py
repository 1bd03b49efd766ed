"""``clean``: repair Unicode, normalise whitespace, and drop documents that are too short or junk.

Repair comes first (ftfy undoes mojibake such as ``cafÃ©`` and normalises to NFC) so that the later
stages compare the text a reader would see. The filters are the cheap heuristics that catch most
boilerplate and binary garbage before any model runs; every drop is counted by its reason.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from dataclasses import dataclass

from data_pipeline.curate.checks import within
from data_pipeline.curate.shards import read_shard, write_shard

# Tab, newline and printable ASCII except '&': a line made only of these is left as it is by every
# ftfy fix (mojibake, HTML entities, control and C1 characters, widths, quotes, line breaks, NFC all
# need some other character), so it need not go through ftfy's per-line pipeline.
_FTFY_CAN_CHANGE = re.compile(r"[^\t\n\x20-\x25\x27-\x7e]")
# Runs of horizontal space, and any single one that is not a plain space: a lone space is left alone (the
# zero-width space U+200B is no space: a break hint inside a word, or between the words of Thai)
_SPACES = re.compile(r"[ \t\f\v\u00a0\u2000-\u200a\u3000]{2,}|[\t\f\v\u00a0\u2000-\u200a\u3000]")
_BLANK_LINES = re.compile(r"\n{3,}")
_INDENT = re.compile(r"[ \t]*")
# Han ideographs and kana: scripts written without spaces between words, where a run between spaces is a
# clause or a sentence; each counts as a word (a Chinese word is one to two of them)
_UNSPACED_CHAR = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")


@functools.cache
def _letters_and_marks() -> tuple[re.Pattern, re.Pattern]:
    """Words and symbols, where a word is made of letters, digits and combining marks. Python's ``\\w``
    leaves out the marks (categories Mn, Mc, Me): the vowel signs and viramas of Devanagari, Tamil,
    Bengali or Thai, which are parts of letters, a third of such prose; counted as symbols they
    dropped whole languages as "symbol ratio", and they split every word in two. The marks' ranges
    come from this Python's Unicode tables, once a process, from the Basic Multilingual Plane only: a
    class of characters within it compiles to one table lookup a character, and one reaching beyond
    it to a search of every range, four times the stage's time (the marks beyond it belong to
    historic scripts and musical notation)."""
    ranges, start = [], None
    for cp in range(0x10001):
        mark = cp < 0x10000 and unicodedata.category(chr(cp))[0] == "M"
        if mark and start is None:
            start = cp
        elif not mark and start is not None:
            ranges.append(f"\\u{start:04x}-\\u{cp - 1:04x}")
            start = None
    marks = "".join(ranges)
    return re.compile(f"[\\w{marks}]+"), re.compile(f"[^\\w\\s{marks}]")


def count_words(text: str) -> int:
    """Runs of letters, digits and marks, each Han or kana character a word of its own: a run stops at
    one ("在2023年" is three words; counted as runs, a line of Chinese after a digit was one word).
    ``\\w``'s underscore is no letter: a line of ``____`` blanks counted as words, and passed."""
    run = _letters_and_marks()[0]
    text = text.replace("_", " ")
    if _UNSPACED_CHAR.search(text) is None:  # most text: one pass of one character class
        return len(run.findall(text))
    return len(_UNSPACED_CHAR.findall(text)) + len(run.findall(_UNSPACED_CHAR.sub(" ", text)))


@dataclass
class CleanConfig:
    fix_unicode: bool = True  # ftfy repair (mojibake, HTML entities, NFC)
    min_words: int = 50  # fewer words than this: dropped as too short
    max_words: int = 1_000_000  # more: dropped as too long (usually a dump, not a document)
    max_symbol_ratio: float = 0.25  # characters that are neither letters, digits nor spaces
    max_repeated_line_ratio: float = 0.3  # share of non-blank lines that repeat an earlier line

    def problems(self) -> list[str]:
        """Out-of-range options; a ratio below 0 or a word range that no document fits drops everything."""
        problems = within("clean.min_words", self.min_words, 0, meaning="it is the fewest words a document may have")
        problems += within("clean.max_words", self.max_words, max(self.min_words, 1),
                           meaning="it is the most words a document may have, and below clean.min_words "
                                   "(or 1) every document would be dropped")
        for name in ("max_symbol_ratio", "max_repeated_line_ratio"):
            problems += within(f"clean.{name}", getattr(self, name), 0, 1, "it is a share, from 0 to 1")
        return problems


def normalise_whitespace(text: str) -> str:
    """Runs of spaces become one space, lines lose trailing spaces, 3+ newlines become two. A line's
    indentation (its leading spaces and tabs) stays as written: it is the structure of code, verse
    and lists, which a corpus for code and prose must keep."""
    lines = []
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        indent = _INDENT.match(line).end()
        rest = _SPACES.sub(" ", line[indent:]).rstrip()
        lines.append(line[:indent] + rest if rest else "")
    return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip("\n")


def drop_reason(text: str, cfg: CleanConfig) -> str | None:
    """Why ``text`` is dropped, or None to keep it."""
    words, symbol = count_words(text), _letters_and_marks()[1]
    if words < cfg.min_words:
        return "too few words"
    if words > cfg.max_words:
        return "too many words"
    if len(symbol.findall(text)) + text.count("_") > cfg.max_symbol_ratio * len(text):  # ``\w`` holds ``_``
        return "symbol ratio"
    lines = [line for line in text.split("\n") if line.strip()]
    if lines and (len(lines) - len(set(lines))) > cfg.max_repeated_line_ratio * len(lines):
        return "repeated lines"
    return None


def repair_unicode(text: str) -> str:
    """``ftfy.fix_text(text)``, with ftfy called only on the lines it could change.

    ftfy fixes a text line by line, except that once a line contains ``<`` (the text looks like
    HTML) entities are no longer unescaped in that line or any later one; the loop below keeps that
    rule. Most web text is mostly plain ASCII lines, and ftfy's fixed cost per line was 80% of the
    clean stage.
    """
    if _FTFY_CAN_CHANGE.search(text) is None:
        return text
    import ftfy

    config = ftfy.TextFixerConfig(explain=False)
    pieces, start = [], 0
    while start < len(text):
        end = min(text.find("\n", start) + 1 or len(text), start + config.max_decode_length)
        line = text[start:end]
        if config.unescape_html == "auto" and "<" in line:
            config = config._replace(unescape_html=False)
        pieces.append(ftfy.fix_and_explain(line, config).text if _FTFY_CAN_CHANGE.search(line) else line)
        start = end
    return "".join(pieces)


def clean_text(text: str, cfg: CleanConfig) -> str:
    return normalise_whitespace(repair_unicode(text) if cfg.fix_unicode else text)


def clean_shard(in_path: str, out_path: str, text_field: str, cfg: CleanConfig) -> dict:
    kept, dropped = [], {}
    bytes_in = bytes_out = 0
    records = read_shard(in_path)
    for record in records:
        raw = record[text_field]
        bytes_in += len(raw.encode("utf-8"))
        text = clean_text(raw, cfg)
        reason = drop_reason(text, cfg)
        if reason is not None:
            dropped[reason] = dropped.get(reason, 0) + 1
            continue
        record[text_field] = text
        bytes_out += len(text.encode("utf-8"))
        kept.append(record)
    write_shard(out_path, kept, like=in_path)
    return {"docs_in": len(records), "docs_out": len(kept), "bytes_in": bytes_in, "bytes_out": bytes_out,
            "dropped": dropped}
