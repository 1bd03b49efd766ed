"""``clean``: repair Unicode, normalise whitespace, and drop documents that are too short or junk.

Repair comes first (ftfy undoes mojibake such as ``cafÃ©`` and normalises to NFC) so that the later
stages compare the text a reader would see. The filters are the cheap heuristics that catch most
boilerplate and binary garbage before any model runs; every drop is counted by its reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from data_pipeline.curate.shards import read_shard, write_shard

_SPACES = re.compile(r"[ \t\f\v\u00a0\u2000-\u200b\u3000]+")
_BLANK_LINES = re.compile(r"\n{3,}")
_WORD = re.compile(r"\w+")
_SYMBOL = re.compile(r"[^\w\s]")


@dataclass
class CleanConfig:
    fix_unicode: bool = True  # ftfy repair (mojibake, HTML entities, NFC)
    min_words: int = 50  # fewer words than this: dropped as too short
    max_words: int = 1_000_000  # more: dropped as too long (usually a dump, not a document)
    max_symbol_ratio: float = 0.25  # characters that are neither letters, digits nor spaces
    max_repeated_line_ratio: float = 0.3  # share of non-blank lines that repeat an earlier line


def normalise_whitespace(text: str) -> str:
    """Runs of spaces become one space, lines lose trailing spaces, 3+ newlines become two."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = [_SPACES.sub(" ", line).strip() for line in text.split("\n")]
    return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()


def drop_reason(text: str, cfg: CleanConfig) -> str | None:
    """Why ``text`` is dropped, or None to keep it."""
    words = len(_WORD.findall(text))
    if words < cfg.min_words:
        return "too few words"
    if words > cfg.max_words:
        return "too many words"
    if len(_SYMBOL.findall(text)) > cfg.max_symbol_ratio * len(text):
        return "symbol ratio"
    lines = [line for line in text.split("\n") if line.strip()]
    if lines and (len(lines) - len(set(lines))) > cfg.max_repeated_line_ratio * len(lines):
        return "repeated lines"
    return None


def clean_text(text: str, cfg: CleanConfig) -> str:
    if cfg.fix_unicode:
        import ftfy

        text = ftfy.fix_text(text)
    return normalise_whitespace(text)


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
    write_shard(out_path, kept)
    return {"docs_in": len(records), "docs_out": len(kept), "bytes_in": bytes_in, "bytes_out": bytes_out,
            "dropped": dropped}
