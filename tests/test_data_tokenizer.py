"""Tokenizers: SentencePiece training (bpe and unigram, byte fallback) and both back ends behind
one interface: lossless round trips, special ids, and clear errors, for a file that is not a
tokenizer as for bad training text."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from data_pipeline.demo_corpus import write_stdlib_jsonl
from data_pipeline.indexed import IndexedDatasetWriter
from data_pipeline.tokenizer import (EOD_ID, MAX_LINE_BYTES, MIN_VOCAB, PAD_ID, HFTokenizer, _lines, check_vocab_size,
                                     load_tokenizer, read_texts, sample_lines, train_sentencepiece)
from megazero.cli import main

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


def test_sentencepiece_numbers_are_split_into_digits(sp_model):
    """Every digit is its own piece (split_digits), so a number's tokens spell it digit by digit,
    whatever numbers the corpus held. (Planted: digits left to merge, which learned '00' and '000'.)"""
    tok = load_tokenizer(sp_model)
    pieces = [tok.pieces()[i] for i in tok.encode("x = 1000 + 2024")]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("10002024")


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
    (tmp_path / "gpt2.json").write_bytes((tmp_path / "tokenizer.json").read_bytes())  # any .json name
    assert isinstance(load_tokenizer(str(tmp_path / "gpt2.json")), HFTokenizer)


def test_special_token_text_in_a_document_stays_text(tmp_path):
    """"<|endoftext|>" typed inside a document is text: encoded as its characters, never as the EOD id
    that ends a document (a fake boundary in the middle of web text), and decoded back unchanged."""
    pytest.importorskip("tokenizers")
    tok = load_tokenizer(make_hf_tokenizer(tmp_path / "tokenizer.json"))
    text = "the end <|endoftext|> and <pad> after"
    for ids in (tok.encode(text), tok.encode_batch([text])[0]):
        assert tok.eod_id not in ids and tok.pad_id not in ids
        assert tok.decode(ids) == text


def test_an_end_of_document_token_not_marked_special_is_refused(tmp_path):
    """An added token not marked special is matched in text whatever ``encode_special_tokens`` says:
    as the EOD, "<|endoftext|>" in a document cut it in two. (Planted: no look at the flag.)"""
    pytest.importorskip("tokenizers")
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    hf = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_tokens([AddedToken("<|endoftext|>", special=False)])
    hf.save(str(tmp_path / "plain.json"))
    with pytest.raises(ValueError, match=r"plain\.json: the end-of-document token '<\|endoftext\|>' is an added "
                                         r"token not marked special"):
        load_tokenizer(str(tmp_path / "plain.json"))
    hf.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    hf.save(str(tmp_path / "special.json"))
    tok = load_tokenizer(str(tmp_path / "special.json"))
    assert tok.eod_id not in tok.encode("a <|endoftext|> b")


def test_a_tokenizer_jsons_template_adds_no_tokens_to_a_document(tmp_path):
    """Many tokenizer.json files carry a post-processor that puts a BOS or EOS around every text;
    a document is its text's tokens alone (preprocessing appends the one EOD), in a batch as alone.
    (Planted: the batch encoded with the template's special tokens.)"""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    (tmp_path / "plain").mkdir()
    plain = make_hf_tokenizer(tmp_path / "plain" / "tokenizer.json")
    hf = Tokenizer.from_file(plain)
    eod, pad = hf.token_to_id("<|endoftext|>"), hf.token_to_id("<pad>")
    hf.post_processor = TemplateProcessing(single="<|endoftext|> $A <pad>", special_tokens=[("<|endoftext|>", eod),
                                                                                           ("<pad>", pad)])
    hf.save(str(tmp_path / "tokenizer.json"))
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode("a").ids[0] == eod  # the template applies
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tok.encode_batch(SAMPLES) == [tok.encode(t) for t in SAMPLES] == load_tokenizer(plain).encode_batch(SAMPLES)


def test_the_most_specific_end_of_document_name_is_taken(tmp_path):
    """A tokenizer.json holding several of the usual names takes the first of EOD_NAMES, most specific
    first: "<|endoftext|>" over "</s>" and "[SEP]" (a BERT-style separator is no document end).
    (Planted: the names tried in reverse.)"""
    pytest.importorskip("tokenizers")
    tok = load_tokenizer(make_hf_tokenizer(tmp_path / "tokenizer.json", ("[SEP]", "</s>", "<|endoftext|>", "[PAD]")))
    assert tok.pieces()[tok.eod_id] == "<|endoftext|>" and tok.pieces()[tok.pad_id] == "[PAD]"


def test_a_sentencepiece_model_without_an_end_of_document_piece_is_refused_only_where_one_is_written(tmp_path,
                                                                                                     capsys):
    """A model trained elsewhere with eos_id=-1 has no </s>; its eod_id would be -1, a token id no
    shard can hold. It loads with none (as a tokenizer.json does), preprocess refuses it before any
    input is read unless --no-eod, which writes none. (Planted: the -1 kept as the id; the check
    removed from preprocess.)"""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(SAMPLES * 50), model_prefix=str(tmp_path / "no_eos"),
                                   vocab_size=40, eos_id=-1, minloglevel=2)
    path = str(tmp_path / "no_eos.model")
    tok = load_tokenizer(path)
    assert tok.eod_id is None and tok.pad_id is None
    docs = tmp_path / "d.jsonl"
    docs.write_text(json.dumps({"text": SAMPLES[0]}) + "\n")
    argv = ["preprocess", "--input", str(docs), "--tokenizer", path, "--no-progress", "--output-prefix"]
    assert main([*argv, str(tmp_path / "eod")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"megazero preprocess: error: {path}: the SentencePiece model has no </s> piece to end each document with "
        "(--no-eod writes none, and needs none); retrain it with eos_id set (megazero tokenizer train does)")
    assert not list(tmp_path.glob("eod*"))
    assert main([*argv, str(tmp_path / "bare"), "--no-eod"]) == 0


def test_a_sentencepiece_end_of_document_piece_at_id_0_is_one(tmp_path):
    """Id 0 is a piece like any other: a model trained with eos_id=0 ends each document with it, and
    pads with it where it has no padding piece (planted: ids above 0 taken, 0 taken for none)."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(SAMPLES * 50), model_prefix=str(tmp_path / "eos_0"),
                                   vocab_size=40, eos_id=0, unk_id=1, bos_id=-1, minloglevel=2)
    tok = load_tokenizer(str(tmp_path / "eos_0.model"))
    assert (tok.eod_id, tok.pad_id) == (0, 0)


def test_hf_tokenizer_without_eod_is_refused_only_where_one_is_written(tmp_path, capsys):
    """A tokenizer.json without an end-of-document token was refused as it loaded, so --no-eod, which
    writes none, could not use it, nor could training (its data.tokenizer) or encoding, which read
    none. It loads; preprocess without --no-eod refuses it before any input is read, saying what the
    token is for; with --no-eod its shard holds the bare tokens and records the tokenizer as ever, and
    a run takes its vocabulary. A token named outright must be there. (Planted: eod required at load.)"""
    pytest.importorskip("tokenizers")
    from data_pipeline.indexed import IndexedDataset
    from data_pipeline.shard_origin import read_origin
    from megazero.config.loader import load_config

    path = make_hf_tokenizer(tmp_path / "tokenizer.json", specials=("<weird>",))
    tok = load_tokenizer(path)
    assert tok.eod_id is None and tok.pad_id is None
    with pytest.raises(ValueError, match="no end-of-document token among"):
        HFTokenizer(path, eod_token="<end>")
    assert HFTokenizer(path, eod_token="<weird>").eod_id == 0
    docs = tmp_path / "d.jsonl"
    docs.write_text(json.dumps({"text": "hello world"}) + "\n")
    argv = ["preprocess", "--input", str(docs), "--tokenizer", path, "--no-progress", "--output-prefix"]
    assert main([*argv, str(tmp_path / "eod")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"megazero preprocess: error: {path}: no end-of-document token among ['<|endoftext|>', '<|end_of_text|>', "
        "'</s>', '<eos>', '<|eot_id|>', '[SEP]'] to end each document with (--no-eod writes none, and needs none); add "
        "one of these to the tokenizer's special tokens")
    assert not list(tmp_path.glob("eod*"))
    assert main([*argv, str(tmp_path / "bare"), "--no-eod"]) == 0
    shard = str(tmp_path / "bare_text_document")
    assert IndexedDataset(shard)[0].tolist() == tok.encode("hello world")
    assert read_origin(shard)["vocab_size"] == tok.vocab_size
    cfg = load_config(None, ["--model.vocab_size", "auto", "--data.tokenizer", path])
    assert cfg.model.vocab_size == tok.vocab_size


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        load_tokenizer(str(tmp_path / "nope.model"))


def test_read_texts_names_bad_lines(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: no key 'text' \(keys: \['body'\]\)"):
        list(read_texts([str(path)]))
    plain = tmp_path / "plain.txt"
    plain.write_text("line one\n\nline two\n")
    assert list(read_texts([str(plain)])) == ["line one", "line two"]
    path.write_text(json.dumps({"text": "not this", "body": "but this"}) + "\n")  # the field asked for
    assert list(read_texts([str(path)], json_key="body")) == ["but this"]


def not_tokenizers(root):
    """Files people pass as --tokenizer by mistake, by name."""
    (root / "notes.txt").write_text("just some text\n")
    (root / "empty.model").write_bytes(b"")
    (root / "config.json").write_text(json.dumps({"hidden_size": 64}))
    (root / "broken.json").write_text('{"model": ')
    (root / "a_folder").mkdir()
    with IndexedDatasetWriter(str(root / "shard"), np.uint16) as w:
        w.add_document([1, 2, 3])
    return ["notes.txt", "empty.model", "config.json", "broken.json", "a_folder", "shard.bin", "shard.idx"]


def test_a_file_that_is_not_a_tokenizer_is_one_clear_error(tmp_path):
    for name in not_tokenizers(tmp_path):
        with pytest.raises(ValueError) as info:
            load_tokenizer(str(tmp_path / name))
        message = str(info.value)
        assert message.startswith(str(tmp_path / name)) and "not a tokenizer" in message, message
        assert "SentencePiece .model" in message and "tokenizer.json" in message and "\n" not in message


@pytest.mark.parametrize("command", ["encode", "preprocess"])
def test_cli_refuses_a_non_tokenizer_in_one_line(tmp_path, capsys, command):
    not_tokenizers(tmp_path)
    docs = tmp_path / "d.jsonl"
    docs.write_text(json.dumps({"text": "x"}) + "\n")
    bad = str(tmp_path / "notes.txt")
    argv = {"encode": ["tokenizer", "encode", "--tokenizer", bad, "x"],
            "preprocess": ["preprocess", "--input", str(docs), "--tokenizer", bad, "--output-prefix",
                           str(tmp_path / "o"), "--no-progress"]}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "notes.txt: not a tokenizer" in err[0]


def test_vocab_size_covers_ids_above_the_token_count(tmp_path):
    """A tokenizer.json whose ids leave a gap: vocab_size is one past the largest id, not the count."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "far": 70_000}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert loaded.vocab_size == 70_001
    assert max(loaded.encode("far away")) < loaded.vocab_size


def test_read_texts_names_file_and_line_of_bad_text(tmp_path):
    (tmp_path / "latin1.txt").write_bytes(b"fine\n\ncaf\xe9\n")
    with pytest.raises(ValueError, match=r"latin1\.txt:3: not UTF-8"):
        list(read_texts([str(tmp_path / "latin1.txt")]))
    (tmp_path / "null.jsonl").write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"text": None}) + "\n")
    with pytest.raises(ValueError, match=r"null\.jsonl:2: field 'text' is null"):
        list(read_texts([str(tmp_path / "null.jsonl")]))
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n' * 2000)[:-30])
    with pytest.raises(OSError, match=r"cut\.jsonl\.gz: the file is truncated or corrupt"):
        list(read_texts([str(tmp_path / "cut.jsonl.gz")]))


def test_text_lines_lose_their_windows_line_ends(tmp_path):
    """A text file written on Windows ends its lines in CR LF: both go, or every line would train the
    tokenizer on a trailing carriage return. (Planted: only the LF stripped.)"""
    (tmp_path / "crlf.txt").write_bytes(b"first line\r\n\r\nsecond\r\n")
    assert list(read_texts([str(tmp_path / "crlf.txt")])) == ["first line", "second"]


def test_records_in_a_file_not_named_as_records_are_refused(tmp_path, capsys):
    """A JSON-lines file named otherwise (``.JSONL``, ``.ndjson``) was trained on as text, its braces,
    keys and escapes learnt as pieces, with exit 0; it is refused, by the command before any input is
    read and by the reader itself (a pipe), while text that only looks like JSON still trains.
    (Planted: the first line not checked; the old substring test for ``.json`` in the name.)"""
    records = "\n" + json.dumps({"text": "alpha", "url": "x"}) + "\n" + json.dumps({"text": "beta"}) + "\n"
    for name in ("corpus.JSONL", "corpus.ndjson"):
        (tmp_path / name).write_text(records)
        with pytest.raises(ValueError, match=rf"{name}: its first non-blank line is a JSON record with the field "
                                             "'text'.*rename it to end in .jsonl"):
            list(read_texts([str(tmp_path / name)]))
        capsys.readouterr()
        assert main(["tokenizer", "train", "--input", str(tmp_path / name),
                     "--model-prefix", str(tmp_path / "tok"), "--vocab-size", "300"]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and f"--input {tmp_path / name}: its first non-blank line" in err, err
    assert list(read_texts([str(tmp_path / "corpus.ndjson")], json_key="body")) == [records.split("\n")[1],
                                                                                   records.split("\n")[2]]
    (tmp_path / "code.txt").write_text('{"a": 1}\n[1, 2]\n')  # JSON, but no record with the field
    assert list(read_texts([str(tmp_path / "code.txt")])) == ['{"a": 1}', "[1, 2]"]
    (tmp_path / "notes.json.txt").write_text("plain words\n")  # ".json" inside the name, read as text
    assert list(read_texts([str(tmp_path / "notes.json.txt")])) == ["plain words"]
    assert not any(p.name.startswith("tok") for p in tmp_path.iterdir())


def test_a_file_named_json_is_read_as_records(tmp_path):
    """Preprocessing reads ``.json`` (and ``.json.gz``) as jsonl, and so must tokenizer training: read
    as plain text, each record's braces, key and escapes would be trained on as if they were the
    text. (Planted: only ``.jsonl`` names taken for records.)"""
    lines = json.dumps({"text": "alpha"}) + "\n" + json.dumps({"text": "beta \u00e9"}) + "\n"
    (tmp_path / "d.json").write_text(lines)
    (tmp_path / "d.json.gz").write_bytes(gzip.compress(lines.encode()))
    assert list(read_texts([str(tmp_path / "d.json"), str(tmp_path / "d.json.gz")])) == ["alpha", "beta \u00e9"] * 2


def test_documents_of_blank_lines_are_no_text_to_train_on(tmp_path):
    """Training reads lines with something on them: documents that hold only newlines and spaces
    give none, which is said as such. (Planted: blank lines passed on to SentencePiece.)"""
    (tmp_path / "blank.jsonl").write_text(json.dumps({"text": "\n   \n\t\n"}) + "\n" + json.dumps({"text": ""}) + "\n")
    with pytest.raises(ValueError, match="the input holds no text to train on"):
        train_sentencepiece(read_texts([str(tmp_path / "blank.jsonl")]), str(tmp_path / "tok"), 300)


def test_a_vocabulary_below_the_minimum_is_refused_before_any_text_is_read(tmp_path):
    """259 pieces cannot hold byte fallback's 256 and the 4 specials; the refusal comes before the
    first line is read (SentencePiece would say so only after reading the whole corpus), and 260 is
    enough. (Planted: the bound one lower.)"""
    def never_read():
        raise AssertionError("the text was read")
        yield

    assert MIN_VOCAB == 260
    check_vocab_size(260)
    with pytest.raises(ValueError, match="vocabulary size 259 is below 260"):
        train_sentencepiece(never_read(), str(tmp_path / "tok"), 259)
    assert not list(tmp_path.iterdir())


def test_training_on_bad_text_raises_the_reader_error(tmp_path):
    """SentencePiece would wrap it in a RuntimeError carrying a printed traceback."""
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "some words"}) + "\n" + "{oops\n")
    with pytest.raises(ValueError, match=r"^\S*d\.jsonl:2: malformed JSON \([^\n]*\)$"):
        train_sentencepiece(read_texts([str(tmp_path / "d.jsonl")]), str(tmp_path / "tok"), 300)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]


def test_a_failed_training_leaves_no_folder(tmp_path):
    """The model's folder is made for SentencePiece to write into; a training that fails removes it."""
    (tmp_path / "d.txt").write_text("a few words\n")
    with pytest.raises(ValueError, match="more than this text can fill"):
        train_sentencepiece(read_texts([str(tmp_path / "d.txt")]), str(tmp_path / "new" / "sub" / "tok"), 100_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.txt"]


def test_a_pipe_is_an_input_and_a_missing_file_is_not(tmp_path):
    """``--input <(zcat a.txt.gz)`` names a pipe, not a regular file: the input check takes it (the
    training reads it), and still refuses a path that is not there. (Planted: ``os.path.isfile``,
    which refused every pipe as "no such file".)"""
    import os

    from megazero.commands.tokenizer import _check_inputs
    from megazero.errors import UserError

    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    _check_inputs([str(pipe)], "text")  # not opened: a pipe is read once, by training
    with pytest.raises(UserError, match=r"none\.txt: no such file"):
        _check_inputs([str(tmp_path / "none.txt")], "text")


def test_a_line_over_4096_bytes_is_split_at_a_space_not_dropped(tmp_path):
    """SentencePiece skips lines over its limit, and such lines were dropped unsaid: a corpus whose
    Chinese came in paragraphs of 1,400 characters trained a vocabulary without one Han piece. Parts
    end before a space where they hold one, else between whole characters. (Planted: dropped.)"""
    latin, han = "ab " * 2000, "中文字" * 1400
    parts = list(_lines([latin + han]))
    assert "".join(parts) == latin + han and all(len(p.encode()) <= MAX_LINE_BYTES for p in parts)
    assert parts[0] == ("ab " * 1365)[:-1] and parts[1].startswith(" ab")  # before the space
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": han + str(i)}) + "\n" for i in range(3)))
    model = load_tokenizer(train_sentencepiece(read_texts([str(tmp_path / "d.jsonl")]), str(tmp_path / "tok"), 270))
    assert len(model.encode("中文字")) <= 2  # learnt pieces, not nine fallback bytes


def test_a_sampled_training_is_the_same_twice_and_the_seed_chooses_the_sample(corpus, tmp_path):
    """SentencePiece samples its input unseeded: two trainings of one corpus of more lines than
    ``max_sentences`` gave different vocabularies. The sample is drawn here, seeded, uniformly."""
    models = [train_sentencepiece(read_texts([corpus]), str(tmp_path / f"tok{k}"), 400, max_sentences=300, seed=seed)
              for k, seed in enumerate((0, 0, 1))]
    first, again, other = ([tok.decode([i]) for i in range(tok.vocab_size)] for tok in map(load_tokenizer, models))
    assert first == again and first != other  # the files differ in the names they record
    counts = np.zeros(20)
    for seed in range(4000):
        sample = sample_lines(iter(range(20)), 5, seed)
        assert len(set(sample)) == 5
        counts[sample] += 1
    assert abs(counts - 1000).max() < 150  # each line taken a quarter of the time (sd 27)
    assert sample_lines(iter(range(3)), 5, 0) == [0, 1, 2]


def test_parquet_files_train_by_their_column(tmp_path, capsys):
    """Preprocessing reads .parquet; training read it as text and blamed a NUL byte."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["alpha beta", "gamma"], "n": [1, 2]}), tmp_path / "d.parquet")
    assert list(read_texts([str(tmp_path / "d.parquet")])) == ["alpha beta", "gamma"]
    argv = ["tokenizer", "train", "--input", str(tmp_path / "d.parquet"), "--model-prefix", str(tmp_path / "tok")]
    assert main([*argv, "--json-key", "body"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "d.parquet: no column 'body' (columns: ['text', 'n']); choose one with --json-key")


def test_a_bad_parquet_row_is_named_with_the_options_training_has(tmp_path):
    """A null text was said in preprocessing's words: --json-keys and --skip-bad-records, which
    ``tokenizer train`` does not have."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["alpha", None]}), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"^\S*d\.parquet: row 1: field 'text' is null, not a string$"):
        list(read_texts([str(tmp_path / "d.parquet")]))


def test_splitting_a_long_line_is_linear_in_its_length():
    """Each part sliced the rest of the line off anew: a 32 MiB line took 10 s (planted: that slice)."""
    import time

    line = "word " * (8 << 20)  # 40 MiB
    start = time.perf_counter()
    parts = sum(1 for _ in _lines([line]))
    assert parts > 10_000 and time.perf_counter() - start < 5
