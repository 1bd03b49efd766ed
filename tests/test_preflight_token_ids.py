"""The preflight check of the largest token id at its boundary: ids run from 0 to vocabulary - 1, so
a shard holding the id equal to a vocabulary's size is past it (the model's embedding, the
tokenizer the shard records, ``data.tokenizer``), and one whose largest id is one less fits. The
largest id ``--check`` reports is the largest of every dataset in the blend, and the model holds every
token of the tokenizer the data names or records."""

from __future__ import annotations

import numpy as np
import pytest

from data_pipeline.indexed import IndexedDatasetWriter
from megazero.cli import main

VOCAB = 64


def _shard(path, largest: int) -> str:
    """16 documents of ids from 1 to 54, each ending with ``largest``."""
    prefix = str(path)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for k in range(16):
            w.add_document(np.append(np.arange(1, 40) + k, largest).astype(np.uint16))
    return prefix


def _tokenizer(path) -> str:
    """A tokenizer of exactly ``VOCAB`` tokens."""
    from tokenizers import Tokenizer, models

    words = {f"w{i}": i for i in range(VOCAB - 2)} | {"<unk>": VOCAB - 2, "</s>": VOCAB - 1}
    Tokenizer(models.WordLevel(words, unk_token="<unk>")).save(str(path))
    return str(path)


def _check(prefix: str, tmp_path, vocab: int, *extra: str, blend: str = "") -> list:
    return ["train", "--model.num_layers", "2", "--model.hidden_size", "32", "--model.num_heads", "4",
            "--model.vocab_size", str(vocab), "--model.seq_length", "16", "--train.micro_batch_size", "2",
            "--train.global_batch_size", "4", "--train.train_steps", "2", "--train.device", "cpu",
            "--data.blend", blend or f"[[1.0, {prefix}]]", "--data.split", "1", "--logging.run_dir", str(tmp_path / "run"),
            "--data.cache_dir", str(tmp_path / "cache"), *extra, "--check"]


def _passes_or_refuses(argv: list, capsys, fits: bool, refusal: str) -> None:
    """``--check`` passes without a word where the data fits, else exits 2 saying ``refusal``."""
    code, err = main(argv), capsys.readouterr().err
    assert ((code, err) == (0, "")) if fits else (code == 2 and refusal in err), err


@pytest.mark.parametrize("vocab, fits", [(VOCAB, False), (VOCAB + 1, True)])
def test_the_model_vocabulary_must_exceed_the_largest_id(tmp_path, capsys, vocab, fits):
    prefix = _shard(tmp_path / "edge_text_document", VOCAB)
    refusal = f"holds token id {VOCAB} but model.vocab_size is {VOCAB}"
    _passes_or_refuses(_check(prefix, tmp_path, vocab), capsys, fits, refusal)


@pytest.mark.parametrize("largest, fits", [(VOCAB, False), (VOCAB - 1, True)])
def test_a_shard_may_not_hold_the_id_its_recorded_tokenizer_lacks(tmp_path, capsys, largest, fits):
    from data_pipeline.shard_origin import tokenizer_identity, write_origin
    from data_pipeline.tokenizer import load_tokenizer

    prefix = _shard(tmp_path / "recorded_text_document", largest)
    write_origin(prefix, tokenizer_identity(load_tokenizer(_tokenizer(tmp_path / "tokenizer.json"))))
    refusal = f"holds token id {VOCAB} but records its tokenizer as"
    _passes_or_refuses(_check(prefix, tmp_path, 2 * VOCAB), capsys, fits, refusal)


@pytest.mark.parametrize("largest, fits", [(VOCAB, False), (VOCAB - 1, True)])
def test_a_shard_may_not_hold_the_id_the_named_tokenizer_lacks(tmp_path, capsys, largest, fits):
    prefix = _shard(tmp_path / "plain_text_document", largest)
    argv = _check(prefix, tmp_path, 2 * VOCAB, "--data.tokenizer", _tokenizer(tmp_path / "tokenizer.json"))
    _passes_or_refuses(argv, capsys, fits, f"holds token id {VOCAB}, beyond the {VOCAB} tokens of data.tokenizer")


def test_check_reports_the_largest_id_of_every_dataset(tmp_path, capsys):
    """The largest id ``--check`` reports is over the whole blend, not the last dataset's."""
    wide, narrow = _shard(tmp_path / "wide_text_document", VOCAB - 1), _shard(tmp_path / "narrow_text_document", 0)
    argv = _check(wide, tmp_path, VOCAB, blend=f"[[1.0, {wide}], [1.0, {narrow}]]")
    assert main(argv) == 0
    assert f"largest token id {VOCAB - 1}," in capsys.readouterr().out


def test_a_dataset_of_weight_0_is_not_checked(tmp_path, capsys):
    """A blend entry of weight 0 is never read (the blend never draws it); its shard missing, or
    holding ids beyond the vocabulary, refused the run all the same. (Planted: every entry opened.)"""
    kept, beyond = _shard(tmp_path / "kept_text_document", 0), _shard(tmp_path / "beyond_text_document", VOCAB)
    for withdrawn in (str(tmp_path / "missing_text_document"), beyond):
        argv = _check(kept, tmp_path, VOCAB, blend=f"[[1.0, {kept}], [0.0, {withdrawn}]]")
        assert main(argv) == 0, capsys.readouterr().err
        assert "data: 1 dataset(s), largest token id 54," in capsys.readouterr().out  # the kept one's


@pytest.mark.parametrize("source", ["named", "recorded"])
@pytest.mark.parametrize("vocab, fits", [(VOCAB - 1, False), (VOCAB, True)])
def test_the_model_vocabulary_must_hold_the_tokenizers(tmp_path, capsys, source, vocab, fits):
    """A model one row short of its tokenizer, named by ``data.tokenizer`` or recorded by the shards,
    is refused though the data's ids fit it; one of exactly the tokenizer's size passes. (Planted:
    either bound one off, passed.)"""
    from data_pipeline.shard_origin import tokenizer_identity, write_origin
    from data_pipeline.tokenizer import load_tokenizer

    prefix, tokenizer = _shard(tmp_path / "small_text_document", 1), _tokenizer(tmp_path / "tokenizer.json")
    extra = ("--data.tokenizer", tokenizer) if source == "named" else ()
    if source == "recorded":
        write_origin(prefix, tokenizer_identity(load_tokenizer(tokenizer)))
    refusal = f"model.vocab_size: {vocab} is smaller than the {VOCAB} tokens of "
    _passes_or_refuses(_check(prefix, tmp_path, vocab, *extra), capsys, fits, refusal)
