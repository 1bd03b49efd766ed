"""Tokenizers behind one small interface, and SentencePiece training.

Preprocessing and training need only five things from a tokenizer: ``encode``, ``decode``,
``vocab_size`` (one more than the largest id it can produce), ``eod_id`` (appended after every
document; None for a ``tokenizer.json`` without one, which only what writes it refuses, through
``require_eod``) and ``pad_id``. Two back ends provide them: SentencePiece ``.model`` files and Hugging
Face ``tokenizer.json`` files (through the ``tokenizers`` package, imported only when such a file
is loaded). Any other file given as a tokenizer is one ValueError naming it, not a traceback.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import math
import os
import random
import re
from collections.abc import Iterable, Iterator
from typing import Protocol

from data_pipeline import file_locks
from data_pipeline.paths import empty_path_problem, made_folder, temp_name

# Ids the trained SentencePiece models reserve, in this order; eod is SentencePiece's </s>.
UNK_ID, BOS_ID, EOD_ID, PAD_ID = 0, 1, 2, 3

# Names a tokenizer.json commonly gives its end-of-document and padding tokens, most specific first.
EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>")
WHAT_A_TOKENIZER_IS = "a SentencePiece .model file or a Hugging Face tokenizer.json (or a folder holding one)"


class Tokenizer(Protocol):
    vocab_size: int  # every id encode() returns is below it
    eod_id: int | None  # None: a tokenizer.json with no end-of-document token (``require_eod``)
    pad_id: int | None  # the end-of-document token where there is no padding one

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def pieces(self) -> list[str]: ...


class SentencePieceTokenizer:
    """A SentencePiece model; never adds BOS/EOS itself (preprocessing appends EOD).

    Batches encode on one thread: preprocessing scales by processes, one per core, and a thread
    pool inside each would only fight them for the same cores.
    """

    def __init__(self, path: str) -> None:
        import sentencepiece as spm

        self.path = path
        try:
            self._sp = spm.SentencePieceProcessor(model_file=path)
        except Exception as exc:  # sentencepiece raises RuntimeError or OSError, worded for its developers
            raise _not_a_tokenizer(path, "SentencePiece", exc) from None
        self.vocab_size = self._sp.get_piece_size()
        # sentencepiece says -1 for a piece the model lacks, a token id no shard can hold: None instead,
        # and what writes an end-of-document token asks for one (``require_eod``)
        eos = self._sp.eos_id() if self._sp.eos_id() >= 0 else None
        self.eod_id = eos
        self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else eos

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts, num_threads=1)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode(list(ids))

    def pieces(self) -> list[str]:
        """Every id's piece, in id order: the vocabulary itself, whatever file holds it."""
        return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]


class HFTokenizer:
    """A Hugging Face ``tokenizer.json``; special tokens are looked up by their usual names."""

    def __init__(self, path: str, eod_token: str | None = None, pad_token: str | None = None) -> None:
        from tokenizers import Tokenizer as _HF

        self.path = path
        try:
            self._tok = _HF.from_file(path)
        except Exception as exc:  # tokenizers raises a bare Exception with the json parser's message
            raise _not_a_tokenizer(path, "Hugging Face tokenizers", exc) from None
        # a document's text is text: "<|endoftext|>" written in it is those characters, not a document
        # boundary (tokenizers would otherwise turn it into the special token's id)
        self._tok.encode_special_tokens = True
        # ids may leave gaps (added tokens placed far above the vocabulary): the count is not enough
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)
        # none is needed to encode, train or generate: what writes one asks for it (``require_eod``)
        self.eod_id = self._find(eod_token, EOD_NAMES, "end-of-document", required=False)
        added = self._tok.get_added_tokens_decoder().get(self.eod_id)
        if added is not None and not added.special:  # ``encode_special_tokens`` keeps special ones from text only
            raise ValueError(f"{path}: the end-of-document token {added.content!r} is an added token not marked "
                             "special, so that text in a document would encode as a document boundary; set "
                             '"special": true on it in the file\'s added_tokens')
        pad = self._find(pad_token, PAD_NAMES, "padding", required=False)
        self.pad_id = self.eod_id if pad is None else pad

    def _find(self, name: str | None, candidates: tuple[str, ...], what: str, required: bool = True) -> int | None:
        for candidate in (name,) if name else candidates:
            token_id = self._tok.token_to_id(candidate)
            if token_id is not None:
                return token_id
        if required or name:
            raise ValueError(f"{self.path}: no {what} token among {list((name,) if name else candidates)}; "
                             f"add one of these to the tokenizer's special tokens")
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.21) skips computing character offsets nobody reads here
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def pieces(self) -> list[str]:
        """Every id's token, in id order ("" for an id no token has): the vocabulary itself."""
        return [self._tok.id_to_token(i) or "" for i in range(self.vocab_size)]


def require_eod(tokenizer: Tokenizer, purpose: str) -> None:
    """Refuse a tokenizer without an end-of-document id, for a caller about to write one (``purpose``
    says what for), naming the tokens looked for (a SentencePiece model: its </s> piece); the caller
    then reads ``tokenizer.eod_id`` where it writes it."""
    if tokenizer.eod_id is None and isinstance(tokenizer, SentencePieceTokenizer):
        raise ValueError(f"{tokenizer.path}: the SentencePiece model has no </s> piece {purpose}; retrain it with "
                         "eos_id set (megazero tokenizer train does)")
    if tokenizer.eod_id is None:
        raise ValueError(f"{tokenizer.path}: no end-of-document token among {list(EOD_NAMES)} {purpose}; add one of "
                         "these to the tokenizer's special tokens")


def _not_a_tokenizer(path: str, backend: str, exc: Exception) -> ValueError:
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ValueError(f"{path}: not a tokenizer ({backend} cannot read it: {detail}); "
                      f"give {WHAT_A_TOKENIZER_IS}")


def load_tokenizer(path: str) -> Tokenizer:
    """A ``.json`` file (or a folder with tokenizer.json) is Hugging Face; any other file SentencePiece.

    A missing path is a FileNotFoundError; anything else that is not a tokenizer (a text file, a
    shard, an empty file, a folder without tokenizer.json) is a ValueError naming it.
    """
    empty = empty_path_problem(path, "tokenizer file", f"give {WHAT_A_TOKENIZER_IS}")
    if empty:
        raise FileNotFoundError(empty)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise ValueError(f"{path}: a folder without tokenizer.json is not a tokenizer; give {WHAT_A_TOKENIZER_IS}")
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: tokenizer file not found (give {WHAT_A_TOKENIZER_IS})")
    if path.endswith(".json"):
        return HFTokenizer(path)
    return SentencePieceTokenizer(path)


def read_texts(paths: Iterable[str], json_key: str = "text") -> Iterator[str]:
    """Documents from text files (one per line), jsonl files or Parquet files (``json_key`` of each
    record or row).

    A line that is not UTF-8, malformed json or a record whose ``json_key`` is not a string is a
    ValueError naming the file and line, as in preprocessing. Records are read from the files named
    as preprocessing reads them (``.jsonl``/``.json``, optionally ``.gz`` or ``.zst``, and
    ``.parquet``); a file of another name whose first line is a record with ``json_key``
    (``corpus.JSONL``, ``.ndjson``) is a ValueError, not text.
    """
    from data_pipeline.sources import (JSONL_SUFFIXES, PARQUET_SUFFIXES, BadRecord, decode_line, iter_batches,
                                       iter_lines, parse_line, record_texts)

    for path in paths:
        if path.endswith(PARQUET_SUFFIXES):
            for batch in iter_batches(path, (json_key,)):
                for row, record in zip(batch.numbers, batch.records):
                    try:
                        yield record_texts(record, (json_key,))[0]
                    except BadRecord as bad:
                        raise ValueError(f"{path}: row {row}: {bad.detail}") from None
            continue
        is_jsonl = path.endswith(JSONL_SUFFIXES)  # the names preprocessing reads as records
        for count, (lineno, line) in enumerate(iter_lines(path)):
            try:
                if is_jsonl:
                    yield parse_line(line, (json_key,))[0]
                    continue
                if count == 0 and is_record_of(line, json_key):
                    raise ValueError(json_lines_named_as_text(path, json_key))
                yield decode_line(line).rstrip("\r\n")
            except BadRecord as bad:
                raise ValueError(f"{path}:{lineno}: {bad.detail}") from None


def is_record_of(line: bytes, json_key: str) -> bool:
    """Whether ``line`` is a JSON object with the field ``json_key``: what a JSON-lines file holds, never
    the first line of a text corpus."""
    import json

    if not line.lstrip().startswith(b"{"):
        return False
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return isinstance(record, dict) and json_key in record


def json_lines_named_as_text(path: str, json_key: str) -> str:
    """The error for JSON records in a file read as text (its first non-blank line is one): trained on as
    text, the records' braces, keys and escapes would become pieces of the vocabulary."""
    return (f"{path}: its first non-blank line is a JSON record with the field {json_key!r}, but only files named "
            ".jsonl/.json (optionally .gz or .zst) are read as records, so it would be trained on as text, braces "
            "and keys too; rename it to end in .jsonl")


MAX_LINE_BYTES = 4096
"""The longest line handed to SentencePiece, which skips longer ones (its limit is 4192 bytes)."""


def _lines(texts: Iterable[str], max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[str]:
    """SentencePiece trains on lines: documents split at newlines, and a line over ``max_line_bytes``
    into parts of at most that, each ending before a space where the part holds one. Dropped, such
    lines took whole documents written as one paragraph out of training: 4 KiB is 1,365 Chinese
    characters, so a script's text could be absent from the vocabulary."""
    for text in texts:
        for line in text.split("\n"):
            if not line.strip():
                continue
            data, start = line.encode("utf-8"), 0
            while len(data) - start > max_line_bytes:  # an offset: slicing off the rest was quadratic
                part = data[start:start + max_line_bytes].decode("utf-8", "ignore")  # whole characters only
                space = part.rfind(" ")
                part = part[:space] if space > 0 else part
                if part.strip():
                    yield part
                start += len(part.encode("utf-8"))
            if data[start:].strip():
                yield data[start:].decode("utf-8")


def sample_lines(lines: Iterable[str], k: int, seed: int) -> list[str]:
    """A uniform sample of ``k`` of ``lines`` (all of them, in order, when there are no more), the
    same for the same lines and seed: SentencePiece's own sampling of its input is unseeded, so two
    trainings on one corpus of more lines than it samples gave different vocabularies. Reservoir
    sampling with geometric skips (Li's algorithm L): one pass, ``k`` lines held, a random draw
    only per line taken."""
    rng = random.Random(seed)

    def uniform() -> float:  # in (0, 1): a draw of 0 has no logarithm
        return rng.random() or uniform()

    it = iter(lines)
    reservoir = [line for _, line in zip(range(k), it)]
    if len(reservoir) < k:
        return reservoir
    w = math.exp(math.log(uniform()) / k)
    while True:
        skip = int(math.log(uniform()) / math.log1p(-w))
        line = next(itertools.islice(it, skip, None), None)
        if line is None:
            return reservoir
        reservoir[rng.randrange(k)] = line
        w *= math.exp(math.log(uniform()) / k)


MIN_VOCAB = 256 + 4
"""The smallest vocabulary a model here can have: byte fallback's 256 pieces and the 4 specials."""


def check_vocab_size(vocab_size: int) -> None:
    """Refuse a vocabulary below ``MIN_VOCAB`` before any text is read (SentencePiece would find it
    only after reading the corpus)."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocabulary size {vocab_size} is below {MIN_VOCAB}: byte fallback alone needs 256 "
                         "pieces, plus 4 special tokens")


def _vocabulary_problem(message: str, vocab_size: int) -> str | None:
    """SentencePiece's vocabulary-size failures in terms of the size asked for (its own words
    point at source lines and at an option this project does not expose)."""
    if m := re.search(r"Vocabulary size is smaller than required_chars\. \d+ vs (\d+)", message):
        return (f"vocabulary size {vocab_size} is below the {m.group(1)} pieces the text's characters and the "
                "special tokens need; give at least that many")
    if m := re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", message):
        return (f"vocabulary size {vocab_size} is more than this text can fill (at most {m.group(1)}); give a "
                "smaller vocabulary or more text")
    return None


def _record_prefix(model_file: str, model_prefix: str) -> None:
    """Rewrite the trained model's record of the prefix it was written under (its trainer spec keeps
    the temporary name, so no two trainings gave the same bytes) as ``model_prefix``."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_file, "rb") as f:
        proto.ParseFromString(f.read())
    proto.trainer_spec.model_prefix = model_prefix
    with open(model_file, "wb") as f:
        f.write(proto.SerializeToString(deterministic=True))


def train_sentencepiece(texts: Iterable[str], model_prefix: str, vocab_size: int, model_type: str = "bpe",
                        max_sentences: int = 2_000_000, num_threads: int | None = None, seed: int = 0) -> str:
    """Train a byte-fallback SentencePiece model; returns the path of the ``.model`` file.

    Whitespace is kept as it is (identity normalisation, no collapsing of spaces) so code and
    indentation survive the round trip; characters outside the vocabulary fall back to bytes, so
    nothing ever becomes ``<unk>``. Newlines are not seen in training (SentencePiece reads lines)
    and encode as the byte piece ``<0x0A>``. At most ``max_sentences`` lines train it, sampled with
    ``seed`` (``sample_lines``): the same corpus and seed give the same model, byte for byte (the
    file records ``model_prefix``, not the temporary name it is trained under). The ``.vocab`` is put
    in place before the ``.model``, which is what every reader opens: a run killed between the two
    leaves a ``.vocab`` alone, never a model without its list of pieces.
    """
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"model_type must be 'bpe' or 'unigram', not {model_type!r}")
    check_vocab_size(vocab_size)
    sample = sample_lines(_lines(texts), max_sentences, seed)  # a reader's error is raised here, as it is
    if not sample:
        raise ValueError("the input holds no text to train on (every file is empty, or every line blank)")
    renaming = False
    with made_folder(os.path.dirname(os.path.abspath(model_prefix))):
        _remove_abandoned(model_prefix)
        tmp_prefix, held = _claim_temporaries(model_prefix)
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sample),
                model_prefix=tmp_prefix, vocab_size=vocab_size, model_type=model_type,
                character_coverage=0.9995, byte_fallback=True, normalization_rule_name="identity",
                remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
                unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOD_ID, pad_id=PAD_ID,
                input_sentence_size=0, shuffle_input_sentence=False,  # sampled above
                num_threads=num_threads or os.cpu_count() or 1, minloglevel=2,
            )
            _record_prefix(tmp_prefix + ".model", model_prefix)
            renaming = True
            for ext in (".vocab", ".model"):
                os.replace(tmp_prefix + ext, model_prefix + ext)
        except BaseException as exc:
            # a half-written or half-placed pair would keep the folder made for it (and block a rerun)
            left = [tmp_prefix + ".model", tmp_prefix + ".vocab"]
            if renaming and os.path.exists(tmp_prefix + ".model") and not os.path.exists(tmp_prefix + ".vocab"):
                left.append(model_prefix + ".vocab")  # put in place, and its .model not
            for path in left:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            if not isinstance(exc, RuntimeError):
                raise
            raise ValueError(_vocabulary_problem(str(exc), vocab_size) or str(exc)) from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_prefix + ".lock")  # still held: no sweep takes it for an abandoned one
            os.close(held)
    return model_prefix + ".model"


def _claim_temporaries(model_prefix: str) -> tuple[str, int]:
    """A temporary prefix to train ``model_prefix`` under, and the descriptor holding the lock of its
    ``.lock`` file (``data_pipeline.file_locks``), which tells this live training's temporaries from
    those of one killed outright (``_remove_abandoned``)."""
    while True:
        tmp_prefix = temp_name(model_prefix)
        with contextlib.suppress(file_locks.Swept):  # another training's sweep took it before its lock
            return tmp_prefix, file_locks.create_locked(tmp_prefix + ".lock")


def _remove_abandoned(model_prefix: str) -> None:
    """Remove what trainings of ``model_prefix`` killed outright (SIGKILL, the OOM killer) left under
    their temporary names: no clean-up of theirs ran, and nothing else would remove them."""
    for lock in glob.glob(glob.escape(model_prefix) + ".tmp-*.lock"):
        stem = lock.removesuffix(".lock")
        file_locks.remove_abandoned(lock, (stem + ".model", stem + ".vocab", lock))
