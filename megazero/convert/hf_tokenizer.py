"""The tokenizer files of an exported Hugging Face folder, encoding text to the ids training saw.

``AutoTokenizer.from_pretrained(folder).encode(text)`` must give the ids megazero's tokenizer
(``data_pipeline.tokenizer``) gave the training data; a model fed other ids is a different model.
Both kinds are written as a ``tokenizer.json`` loaded by ``PreTrainedTokenizerFast``, the one
class every ``transformers`` version reads without conversion:

* a ``tokenizer.json`` is copied without its post-processor: megazero encodes without special
  tokens (documents are separated by end-of-document only), so a template that adds BOS would
  give ids the model never saw;
* a SentencePiece model is translated piece for piece (its BPE merges ranked by piece score, or
  its unigram scores; byte fallback; its own normalizer settings), because ``transformers``' own
  translations assume a particular model's settings (Llama's: no leading-space or unigram
  handling that matches ours). The ``.model`` file is kept beside it.

For both, a special token's text inside a document is text (``split_special_tokens``), as megazero
encodes it: SentencePiece never matches special pieces in text, and ``HFTokenizer`` encodes with
``encode_special_tokens``, so no document's own words become an end-of-document.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megazero.errors import UserError

SPACE = "\u2581"  # SentencePiece's visible space
WITHOUT = "export without a tokenizer (--tokenizer none)"


class Untranslatable(ValueError):
    """Why a SentencePiece model cannot be written for ``transformers`` so that it encodes alike;
    ``load_fitting`` names the tokenizer and its source."""


@dataclass(frozen=True)
class ExportTokenizer:
    """A tokenizer and the files an export writes for it, made in memory when it is loaded: a
    tokenizer that does not fit the model, or that ``transformers`` cannot take, is refused before
    any weight is written."""

    tok: object  # the ``data_pipeline.tokenizer`` tokenizer: the ids training saw
    spec: dict  # tokenizer.json
    config: dict  # tokenizer_config.json
    sentencepiece: Optional[str]  # the SentencePiece .model kept beside it, if that is the kind

    @property
    def ids(self) -> dict:
        """The special token ids a Hugging Face ``config.json`` records."""
        return {"eos_token_id": self.tok.eod_id, "pad_token_id": self.tok.pad_id}


def load_fitting(path: str, vocab_size: int, max_length: int, where: str = "--tokenizer") -> ExportTokenizer:
    """The tokenizer at ``path`` with its export files; refused when it does not load, is a kind
    ``transformers`` cannot take, or has more tokens than the model has rows (the folder written would
    encode text to ids the model cannot embed). ``where`` names where the path came from."""
    from data_pipeline.tokenizer import HFTokenizer, load_tokenizer, require_eod

    try:
        tok = load_tokenizer(path)
        require_eod(tok, "for the exported config's eos_token_id")
    except (ValueError, OSError) as e:
        raise UserError(f"{where} {path}: {e}") from None
    if tok.vocab_size > vocab_size:
        raise UserError(f"{where} {path}: has {tok.vocab_size} tokens, but the model has {vocab_size}; give "
                        "the tokenizer the model was trained with")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "split_special_tokens": True}  # a special token's text inside text is text, as megazero encodes it
    if isinstance(tok, HFTokenizer):
        from tokenizers import Tokenizer

        spec = json.loads(Path(tok.path).read_text(encoding="utf-8"))
        spec["post_processor"] = None
        piece = Tokenizer.from_file(tok.path).id_to_token
    else:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=tok.path)
        try:
            spec = json.loads(_sentencepiece_as_json(tok.path, sp))
        except Untranslatable as e:
            raise UserError(f"{where} {path}: {e}; {WITHOUT}") from None
        piece = sp.id_to_piece
        config.update(unk_token=piece(sp.unk_id()))
    config.update(eos_token=piece(tok.eod_id), pad_token=piece(tok.pad_id))
    return ExportTokenizer(tok, spec, config, None if isinstance(tok, HFTokenizer) else tok.path)


def write_tokenizer(tokenizer: ExportTokenizer, out: Path) -> None:
    if tokenizer.sentencepiece is not None:
        shutil.copyfile(tokenizer.sentencepiece, out / "tokenizer.model")
    (out / "tokenizer.json").write_text(json.dumps(tokenizer.spec, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer.config, indent=2, ensure_ascii=False) + "\n")


def _sentencepiece_as_json(path: str, sp) -> str:
    """A ``tokenizers`` pipeline that encodes as the SentencePiece model at ``path`` (loaded: ``sp``) does."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE, Unigram

    proto = _sentencepiece_proto(path)
    piece_type, spec, norm = pb.ModelProto.SentencePiece, proto.trainer_spec, proto.normalizer_spec
    pieces = list(proto.pieces)
    textual = _textual_types()
    if spec.model_type == pb.TrainerSpec.BPE:
        normal = {p.piece: (-p.score, i) for i, p in enumerate(pieces) if p.type == piece_type.NORMAL}
        ranked = sorted((normal[t], t[:k], t[k:]) for t in normal for k in range(1, len(t))
                        if t[:k] in normal and t[k:] in normal)
        model = BPE({p.piece: i for i, p in enumerate(pieces)}, [(a, b) for _, a, b in ranked],
                    unk_token=pieces[spec.unk_id].piece, fuse_unk=True, byte_fallback=spec.byte_fallback)
    else:
        never = min(p.score for p in pieces) - 1e6  # special and byte pieces: only by fallback, never from text
        model = Unigram([(p.piece, p.score if p.type in textual else never) for p in pieces], spec.unk_id,
                        spec.byte_fallback)
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = _normalizer(norm)
    if spec.model_type == pb.TrainerSpec.BPE:
        _add_user_defined(tokenizer, [p.piece for p in pieces if p.type == piece_type.USER_DEFINED])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if norm.add_dummy_prefix else []))
    _refuse_disagreement(sp, tokenizer, PROBES + _own_probes(pieces))
    return tokenizer.to_str()


PROBES = ["def f(x):\n  return x + 1\n", " two  spaces\tand tab\n\n", " leading", "trailing ", "\n\nnewlines",
          "ünïcødé ✓ 日本語 🙂", "year 2024, pi 3.14159", "</s> <pad> <unk> <s> <|endoftext|> <0x0A>",
          "a\r\nb\rc", "\u2581 a\u2581b \u2581", "x\u0301 e\u0308", "CAPS, lower; (brackets) [x] {y}", "", " ", "\t"]
"""Texts any exported SentencePiece model must encode as SentencePiece does: code, whitespace at
both ends, special pieces' text, other scripts. No run of three or more spaces: where a unigram
model can split one into the same pieces in two orders, SentencePiece's float32 sums pick one by
rounding, which tokenizers' float64 sums cannot follow (a tie, either split as good)."""


def _own_probes(pieces: list) -> list:
    """Up to 256 characters of the model's own pieces, spread over them, and its user-defined pieces:
    what the fixed probes may not touch."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    kinds = _textual_types()
    characters = sorted({c for p in pieces if p.type in kinds for c in p.piece} - {SPACE})
    user_defined = [p.piece for p in pieces if p.type == pb.ModelProto.SentencePiece.USER_DEFINED]
    return characters[:: -(-len(characters) // 256) or 1] + user_defined


def _refuse_disagreement(sp, tokenizer, texts: list) -> None:
    """The last check, on the translation as a whole: ``texts`` encoded both ways (``sp``: the
    SentencePiece model), and the first one they disagree on named, before anything is written. It
    holds back a tokenizer that would feed the model ids other than training did, whatever part of
    the translation is wrong."""
    tokenizer.encode_special_tokens = True  # split_special_tokens, as tokenizer_config.json asks
    theirs = tokenizer.encode_batch(texts, add_special_tokens=False)
    for text, ours, encoding in zip(texts, sp.encode(texts), theirs):
        if encoding.ids != ours:
            raise Untranslatable(f"the translation for transformers encodes {text!r} as {encoding.tokens} where "
                                 f"SentencePiece gives {[sp.id_to_piece(i) for i in ours]}")


def _normalizer(norm):
    """SentencePiece's whitespace handling of ``norm`` (its ``normalizer_spec``; a character map is
    refused before), step by step in its order. It removes trailing whitespace after escaping it,
    so a ``\u2581`` written at the end of the text goes as well; leading and repeated whitespace it
    removes before, where a written ``\u2581`` is not whitespace."""
    from tokenizers import Regex, normalizers

    steps = []
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex(r"\A +"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if norm.add_dummy_prefix:
        steps.append(normalizers.Prepend(" "))
    if norm.escape_whitespaces:
        steps.append(normalizers.Replace(" ", SPACE))
    if norm.remove_extra_whitespaces:
        steps.append(normalizers.Replace(Regex(f"{SPACE if norm.escape_whitespaces else ' '}+\\z"), ""))
    return normalizers.Sequence(steps)


def _add_user_defined(tokenizer, symbols: list) -> None:
    """SentencePiece's BPE takes a user-defined piece whole wherever its text occurs (after
    normalisation) and never merges into or across it, which tokenizers' BPE cannot do from
    merges: they become added tokens, cut out of the normalised text before the model runs.
    tokenizers normalises an added token's own text to find it, so one that normalisation would
    change is never found."""
    from tokenizers import AddedToken

    for symbol in symbols:
        if tokenizer.normalizer.normalize_str(symbol) != symbol:
            raise Untranslatable(f"the user-defined piece {symbol!r} of this BPE model cannot be exported "
                                 f"(transformers would look for it as {tokenizer.normalizer.normalize_str(symbol)!r})")
    tokenizer.add_tokens([AddedToken(symbol, normalized=True, special=False) for symbol in symbols])


def _sentencepiece_proto(path: str):
    """The SentencePiece model at ``path``; a kind other than BPE and unigram is refused."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(Path(path).read_bytes())
    if proto.trainer_spec.model_type not in (pb.TrainerSpec.BPE, pb.TrainerSpec.UNIGRAM):
        kind = pb.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type)
        raise Untranslatable(f"a SentencePiece {kind} model cannot be written for transformers (bpe and unigram can)")
    if proto.normalizer_spec.precompiled_charsmap:
        raise Untranslatable(f"its {proto.normalizer_spec.name or 'custom'} normalisation cannot be written for "
                             "transformers, whose tokenizers applies SentencePiece's character map to whole grapheme "
                             "clusters (a letter with a combining accent, or \\r\\n, would encode otherwise; models "
                             "trained with normalization_rule_name=identity export)")
    special = _special_text_reached(proto)
    if special:
        raise Untranslatable(f"{special}; retrain the model with every character of its special pieces covered "
                             "(character_coverage=1.0)")
    return proto


def _special_text_reached(proto) -> Optional[str]:
    """Which special piece (control, unknown, byte, unused) the translated model would make from
    text, where SentencePiece never does. tokenizers' BPE starts from single characters, so it
    gives a one-character special piece its id; its unigram lattice holds every piece, and a piece
    it cannot spell otherwise beats the unknown token (scored below every piece), so the text
    ``</s>`` becomes ``</s>`` in a model without a piece for ``<``."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    kinds = _textual_types()
    textual = {p.piece for p in proto.pieces if p.type in kinds}
    unigram = proto.trainer_spec.model_type == pb.TrainerSpec.UNIGRAM
    for i, p in enumerate(proto.pieces):
        reachable = unigram or len(p.piece) == 1
        if p.type in kinds or not reachable or _spelled(p.piece, textual):
            continue
        missing = next(c for c in p.piece if c not in textual)
        model = "unigram" if unigram else "BPE"
        return (f"the text {p.piece!r} would become the special piece {p.piece!r} (id {i}) in transformers but not "
                f"in SentencePiece, as this {model} model has no piece for {missing!r}")
    return None


def _textual_types() -> tuple:
    """The SentencePiece piece types text can become directly (the rest come only from ids or fallback)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    piece_type = pb.ModelProto.SentencePiece
    return piece_type.NORMAL, piece_type.USER_DEFINED


def _spelled(text: str, pieces: set) -> bool:
    """Whether ``text`` is a sequence of ``pieces``."""
    reached = [True] + [False] * len(text)
    for start in range(len(text)):
        if reached[start]:
            for end in range(start + 1, len(text) + 1):
                reached[end] = reached[end] or text[start:end] in pieces
    return reached[-1]


def import_notes(folder: Path, path: Path, tokenizer, config: dict) -> list[str]:
    """What an imported folder's model was run with around a text that megazero does not do: a
    post-processor adding tokens (a BOS) to every text, which megazero's encoding leaves out (its
    documents are separated by the end-of-document token alone), and end-of-text ids (``config.json``
    and ``generation_config.json``'s ``eos_token_id``) other than the end-of-document token megazero
    finds by name, the one ``megazero generate`` stops at. Said on import, as nothing later would."""
    notes = []
    if path.suffix == ".json":
        from tokenizers import Tokenizer

        hf = Tokenizer.from_file(str(path))
        plain, full = (hf.encode("a", add_special_tokens=flag).ids for flag in (False, True))
        added = [hf.id_to_token(i) for i in full if i not in plain]
        leading = [hf.id_to_token(i) for i in full[:full.index(plain[0])]] if plain and plain[0] in full else []
        if added:
            hint = f"; give `megazero generate` {' '.join(f'--prepend {shlex.quote(t)}' for t in leading)}" \
                if leading else ""
            notes.append(f"{path}: its post-processor puts {' '.join(added)} around every text, and megazero encodes "
                         f"without it: prompts to `megazero generate` and shards of `megazero preprocess` hold no "
                         f"{' '.join(added)}, which this model was trained to see{hint}")
    eos = set(_eos_ids(config))
    generation = folder / "generation_config.json"
    if generation.is_file():
        with contextlib.suppress(OSError, ValueError):
            eos |= set(_eos_ids(json.loads(generation.read_text(encoding="utf-8"))))
    if eos and eos != {tokenizer.eod_id}:
        pieces = tokenizer.pieces()  # every id's token: built once (a vocabulary may be 200,000 ids)
        names = ", ".join(f"{pieces[i] if 0 <= i < len(pieces) else '?'} ({i})" for i in sorted(eos))
        ours = "none" if tokenizer.eod_id is None else f"{pieces[tokenizer.eod_id]} ({tokenizer.eod_id})"
        others = " ".join(f"--stop-at {shlex.quote(pieces[i])}" for i in sorted(eos - {tokenizer.eod_id})
                          if 0 <= i < len(pieces) and pieces[i])
        notes.append(f"{folder}: the model ends a text with {names} (eos_token_id), megazero's end-of-document "
                     f"token is {ours}: `megazero generate` stops at that one alone"
                     + (f" unless given {others}" if others else ""))
    return notes


def _eos_ids(config: dict) -> list[int]:
    value = config.get("eos_token_id") if isinstance(config, dict) else None
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
