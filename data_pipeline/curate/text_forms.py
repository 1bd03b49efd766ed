"""One Unicode form for every stage that compares text: the same words written with a combining accent
or with the precomposed letter must hash, shingle and match alike, whether or not the clean stage
(whose Unicode repair composes) ran before, and whichever form a task file uses."""

from __future__ import annotations

import unicodedata


def composed(text: str) -> str:
    """``text`` in NFC: a decomposed "é" (a letter and a combining mark) would otherwise hash unlike the
    precomposed one. Most text already is NFC, which the check finds without copying."""
    return text if unicodedata.is_normalized("NFC", text) else unicodedata.normalize("NFC", text)
