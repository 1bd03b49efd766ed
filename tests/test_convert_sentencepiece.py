"""SentencePiece models that megazero's own ``tokenizer train`` does not make, as a user may bring
them to ``megazero convert --to hf``: the exported tokenizer encodes every text as the model does,
or the export is refused, in one line naming the model and what cannot be exported, before any
file is written."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install tokenizers)")

from megazero.convert.hf_tokenizer import load_fitting
from megazero.errors import UserError

LINES = ["the quick brown fox jumps over the lazy dog", "def f(x): return x + 1", "a  b   c\td",
         "pack my box with five dozen liquor jugs", "0123456789 sphinx of black quartz, judge my vow"]
SPECIALS = "if a < b or c > d: x = a / b  # ABCDEF"  # the characters of <unk>, </s>, <pad>, <0x0A>, ...


def train(tmp_path, name, lines=(*LINES, SPECIALS), **options):
    """A small SentencePiece model of ``options`` over ``lines`` (ids as megazero reserves them, no
    character map unless ``options`` name one)."""
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(list(lines) * 20) + "\n")
    settings = dict(input=str(corpus), model_prefix=str(tmp_path / name), vocab_size=360, unk_id=0, bos_id=1, eos_id=2,
                    pad_id=3, minloglevel=2, hard_vocab_limit=False, normalization_rule_name="identity")
    settings.update(options)
    spm.SentencePieceTrainer.train(**settings)
    return str(tmp_path / f"{name}.model")


def exported(path):
    """The tokenizer ``convert --to hf`` would write for ``path``, as ``transformers`` encodes with it."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(json.dumps(load_fitting(path, 1 << 20, 64).spec))
    tok.encode_special_tokens = True  # split_special_tokens, as the exported config asks
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def refusal(path) -> str:
    with pytest.raises(UserError) as caught:
        load_fitting(path, 1 << 20, 64)
    return str(caught.value)


@pytest.mark.parametrize("options,special", [
    ({"model_type": "unigram"}, "'<unk>' (id 0)"),
    ({"model_type": "bpe", "control_symbols": ["q"]}, "'q' (id 4)")], ids=["unigram", "bpe"])
def test_a_special_piece_that_text_would_become_is_refused(tmp_path, options, special):
    """Nothing in LINES has a '<': tokenizers' unigram lattice read the text '<unk>' or '</s>' as that
    special id, which SentencePiece never gives text; its BPE gives a one-character special piece
    (here a control symbol 'q') to the character itself."""
    path = train(tmp_path, "sp", LINES, byte_fallback=True, **options)
    err = refusal(path)
    assert err.startswith(f"--tokenizer {path}: the text ") and special in err and "\n" not in err, err


def disagreeing(path, texts):
    """The texts the exported tokenizer encodes otherwise than the SentencePiece model at ``path``."""
    import sentencepiece as spm

    sp, theirs = spm.SentencePieceProcessor(model_file=path), exported(path)
    return [text for text in texts if theirs(text) != sp.encode(text)]


SYMBOL_TEXTS = ["x<sep>y", "<sep>", "<sep><sep>", "[INST] hi", "a [INST]b", "abc def", "define undef", "  <sep>  ",
                "<se p> <sepp>", "the theme"]


def test_bpe_user_defined_pieces_are_taken_whole(tmp_path):
    """SentencePiece's BPE takes a user-defined piece wherever its text occurs; the export never gave
    them (no merges lead to them)."""
    path = train(tmp_path, "sp", model_type="bpe", byte_fallback=True, add_dummy_prefix=False,
                 user_defined_symbols=["<sep>", "[INST]", "ab", "def", "\u2581the"])
    assert disagreeing(path, SYMBOL_TEXTS) == []


def test_bpe_user_defined_pieces_behind_a_dummy_prefix_are_refused(tmp_path):
    """tokenizers looks for an added token as the normaliser makes its text: with SentencePiece's
    dummy prefix, '<sep>' would be looked for as '▁<sep>'."""
    path = train(tmp_path, "sp", model_type="bpe", byte_fallback=True, user_defined_symbols=["<sep>"])
    err = refusal(path)
    want = f"--tokenizer {path}: the user-defined piece '<sep>' of this BPE model cannot be exported"
    assert err.startswith(want), err


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_a_written_visible_space_at_the_end_goes_with_trailing_whitespace(tmp_path, model_type):
    """SentencePiece drops trailing whitespace after turning spaces into '\u2581', so a '\u2581' written at
    the end of the text is dropped too (not at the start, nor between words)."""
    path = train(tmp_path, "sp", model_type=model_type, byte_fallback=True)
    texts = ["a\u2581", "a \u2581 ", "\u2581", "x  \u2581\u2581", "\u2581 a", "a \u2581 b", " \u2581a\u2581 \u2581"]
    assert disagreeing(path, texts) == []


def test_a_character_map_is_refused(tmp_path):
    """SentencePiece's default nmt_nfkc normalisation: tokenizers' Precompiled maps a grapheme cluster
    by its first character, so '\\r\\n' became one space (SentencePiece: two) and 'Ａ' with a combining
    accent became 'A' (SentencePiece: 'Á')."""
    path = train(tmp_path, "sp", model_type="unigram", byte_fallback=True, normalization_rule_name="nmt_nfkc")
    err = refusal(path)
    assert err.startswith(f"--tokenizer {path}: its nmt_nfkc normalisation cannot be written for transformers"), err


def test_a_translation_that_disagrees_anywhere_is_refused(tmp_path, monkeypatch):
    """The last check encodes fixed texts, characters of the model's pieces and its user-defined
    pieces both ways: a translation wrong in a part no other check covers (here: user-defined pieces
    left out) is refused naming the first text it gets wrong."""
    from megazero.convert import hf_tokenizer

    path = train(tmp_path, "sp", model_type="bpe", byte_fallback=True, add_dummy_prefix=False,
                 user_defined_symbols=["<sep>"])
    monkeypatch.setattr(hf_tokenizer, "_add_user_defined", lambda *args: None)
    err = refusal(path)
    assert err.startswith(f"--tokenizer {path}: the translation for transformers encodes '<sep>' as "), err
    assert "where SentencePiece gives ['<sep>']" in err and "\n" not in err, err


def test_a_run_tokenizer_that_cannot_be_exported_names_its_source_and_the_way_out(tmp_path, capsys):
    """A checkpoint's own data.tokenizer is exported by default; one that cannot be exported was
    refused with "export without --tokenizer", which a user who gave no --tokenizer could not do.
    The line names the run's data.tokenizer, and ``--tokenizer none`` exports the weights alone."""
    import numpy as np

    from data_pipeline.indexed import IndexedDatasetWriter
    from megazero.cli import main
    from tests.bad_input_files import _model

    path = train(tmp_path, "sp", model_type="unigram", byte_fallback=True, normalization_rule_name="nmt_nfkc")
    prefix = str(tmp_path / "text_document")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for doc in np.random.default_rng(0).integers(4, 300, (32, 40)):
            w.add_document(doc.astype(np.uint16))
    run = tmp_path / "run"
    assert main(["train", *_model(prefix, str(run)), "--train.train_steps", "1", "--model.vocab_size", "512",
                 "--data.tokenizer", path]) == 0
    capsys.readouterr()
    assert main(["convert", str(run / "checkpoints"), str(tmp_path / "hf"), "--to", "hf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"the run's data.tokenizer {path}: its nmt_nfkc normalisation" in err[0], err
    assert err[0].endswith("export without a tokenizer (--tokenizer none)") and not (tmp_path / "hf").exists(), err
    assert main(["convert", str(run / "checkpoints"), str(tmp_path / "hf"), "--to", "hf", "--tokenizer", "none"]) == 0
    assert (tmp_path / "hf" / "config.json").is_file() and not (tmp_path / "hf" / "tokenizer.json").exists()


@pytest.mark.parametrize("count", [200, 300, 1000])
def test_own_probes_take_up_to_256_characters_spread_over_the_pieces(count):
    """A model's own characters are probed up to 256 of them, from first to last, so a character the
    fixed probes miss is reached wherever it sorts (planted: the first character alone, passed;
    300 characters gave all 300 and 1,000 gave 334)."""
    from types import SimpleNamespace

    from sentencepiece import sentencepiece_model_pb2 as pb

    from megazero.convert.hf_tokenizer import _own_probes

    normal, user = pb.ModelProto.SentencePiece.NORMAL, pb.ModelProto.SentencePiece.USER_DEFINED
    characters = [chr(0x4E00 + i) for i in range(count)]
    user_defined = characters[0] + characters[-1]  # probed whole, adding no character of its own
    pieces = [SimpleNamespace(piece=c, type=normal) for c in characters]
    pieces.append(SimpleNamespace(piece=user_defined, type=user))
    *own, last = _own_probes(pieces)
    step = -(-count // 256)  # every step-th character: the last probed is within one step of the end
    assert last == user_defined and min(count, 128) <= len(own) <= 256
    assert own[0] == characters[0] and characters.index(own[-1]) >= count - step
