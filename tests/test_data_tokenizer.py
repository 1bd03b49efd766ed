"""Tokenizers: SentencePiece training (bpe and unigram, byte fallback) and both back ends behind
one interface: lossless round trips, special ids, and clear errors."""

from __future__ import annotations

import json

import pytest

from data_pipeline.demo_corpus import write_stdlib_jsonl
from data_pipeline.tokenizer import EOD_ID, PAD_ID, HFTokenizer, load_tokenizer, read_texts, train_sentencepiece

SAMPLES = ["def f(x):\n    return x + 1\n", "  two  spaces\tand tab\n\n", "ünïcødé ✓ 日本語 🙂", "12345 67"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "stdlib.jsonl"
    write_stdlib_jsonl(str(path), max_bytes=300_000)
    return str(path)


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def sp_model(request, corpus, tmp_path_factory):
    prefix = tmp_path_factory.mktemp("sp") / request.param
    return train_sentencepiece(read_texts([corpus]), str(prefix), 600, request.param, max_sentences=50_000)


def test_sentencepiece_round_trip_is_lossless(sp_model):
    tok = load_tokenizer(sp_model)
    assert tok.vocab_size == 600
    for text in SAMPLES:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode_batch(SAMPLES) == [tok.encode(t) for t in SAMPLES]


def test_sentencepiece_special_ids(sp_model):
    tok = load_tokenizer(sp_model)
    assert (tok.eod_id, tok.pad_id) == (EOD_ID, PAD_ID)
    assert tok.eod_id not in tok.encode("some text </s>")  # no BOS/EOS added, text never makes EOD


def test_sentencepiece_learns_the_corpus(sp_model):
    """Common code tokens compress well: far fewer tokens than bytes."""
    tok = load_tokenizer(sp_model)
    text = "    def __init__(self, name):\n        self.name = name\n        return None\n"
    assert len(tok.encode(text)) < len(text.encode()) / 2


def make_hf_tokenizer(path, specials=("<|endoftext|>", "<pad>")):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SAMPLES * 20, trainer)
    tok.save(str(path))
    return str(path)


def test_hf_tokenizer_json(tmp_path):
    pytest.importorskip("tokenizers")
    tok = load_tokenizer(make_hf_tokenizer(tmp_path / "tokenizer.json"))
    assert isinstance(tok, HFTokenizer)
    assert (tok.eod_id, tok.pad_id) == (0, 1)
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch(SAMPLES) == [tok.encode(t) for t in SAMPLES]
    assert load_tokenizer(str(tmp_path)).vocab_size == tok.vocab_size  # a folder holding tokenizer.json


def test_hf_tokenizer_without_eod_is_refused(tmp_path):
    pytest.importorskip("tokenizers")
    path = make_hf_tokenizer(tmp_path / "tokenizer.json", specials=("<weird>",))
    with pytest.raises(ValueError, match="no end-of-document token"):
        load_tokenizer(path)
    tok = HFTokenizer(path, eod_token="<weird>")
    assert tok.eod_id == tok.pad_id == 0


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        load_tokenizer(str(tmp_path / "nope.model"))


def test_read_texts_names_bad_lines(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: cannot read key 'text'"):
        list(read_texts([str(path)]))
    plain = tmp_path / "plain.txt"
    plain.write_text("line one\n\nline two\n")
    assert list(read_texts([str(plain)])) == ["line one", "line two"]
