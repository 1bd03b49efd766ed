"""The tokenizer files `megazero convert --to hf --tokenizer` writes load with
``transformers.AutoTokenizer`` and encode text to the ids megazero's tokenizer gave the training
data, and decode them back the same, for each kind the exporter takes: SentencePiece BPE and
unigram models trained by megazero, and a ``tokenizer.json`` (one with a post-processor that adds
BOS, which megazero never does)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

from data_pipeline.demo_corpus import write_stdlib_jsonl
from data_pipeline.tokenizer import load_tokenizer, read_texts, train_sentencepiece
from megazero.cli import main
from tests.test_data_tokenizer import SAMPLES, make_hf_tokenizer

TEXTS = [*SAMPLES, " leading space", "   three spaces first", "trailing space ", "\n\nnewlines first", "",
         "year 2024, pi 3.14159", "special text: <pad> </s> <unk> <s> <|endoftext|>", "ends with a newline\n"]


def _bos_template(path):
    """A tokenizer.json whose post-processor adds BOS, as many published ones do."""
    from tokenizers import processors

    spec = json.loads(Path(make_hf_tokenizer(path, specials=("<|endoftext|>", "<pad>", "<s>"))).read_text())
    spec["post_processor"] = json.loads(processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 2)]).__getstate__())
    path.write_text(json.dumps(spec))
    return str(path)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    corpus = root / "stdlib.jsonl"
    write_stdlib_jsonl(str(corpus), max_bytes=300_000)
    made = {kind: train_sentencepiece(read_texts([str(corpus)]), str(root / kind), 600, kind, max_sentences=50_000)
            for kind in ("bpe", "unigram")}
    (root / "json").mkdir()
    (root / "bos").mkdir()
    made["json"] = make_hf_tokenizer(root / "json" / "tokenizer.json")
    made["json-bos"] = _bos_template(root / "bos" / "tokenizer.json")
    return made


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small megazero checkpoint (from a random Llama) to export."""
    root = tmp_path_factory.mktemp("tok-ckpt")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      vocab_size=600, max_position_embeddings=16)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "hf")
    assert main(["convert", str(root / "hf"), str(root / "mz")]) == 0
    return root / "mz"


@pytest.mark.parametrize("kind", ["bpe", "unigram", "json", "json-bos"])
def test_exported_tokenizer_encodes_as_ours(tokenizers, checkpoint, tmp_path, kind):
    ours = load_tokenizer(tokenizers[kind])
    assert main(["convert", str(checkpoint), str(tmp_path / "hf"), "--tokenizer", tokenizers[kind]]) == 0
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (theirs.eos_token_id, theirs.pad_token_id) == (ours.eod_id, ours.pad_id)
    if kind in ("bpe", "unigram"):  # SentencePiece's unknown piece is named too (planted: left out, passed)
        import sentencepiece as spm

        assert theirs.unk_token_id == spm.SentencePieceProcessor(model_file=tokenizers[kind]).unk_id()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"]) == (ours.eod_id, ours.pad_id)
    for text in TEXTS:
        ids = ours.encode(text)
        assert theirs.encode(text) == ids, text
        assert theirs(text)["input_ids"] == ids, text
        assert theirs.decode(ids) == ours.decode(ids), text


def test_a_run_tokenizer_gone_from_this_machine_exports_the_weights_alone(tmp_path):
    """A checkpoint converted on another machine than it trained on may name a data.tokenizer that is
    not there: without --tokenizer the export writes the weights alone rather than failing on a
    tokenizer nobody asked for."""
    from megazero.checkpoint import read_manifest
    from megazero.checkpoint.format import CHECKSUM, COMPLETE, complete_text
    from megazero.convert.targets import write_megazero
    from tests.convert_sources import RandomSource

    ckpt = write_megazero(RandomSource(num_layers=1), tmp_path / "mz")
    record = {k: v for k, v in read_manifest(ckpt).items() if k != CHECKSUM}
    record["meta"]["config"]["data"]["tokenizer"] = str(tmp_path / "elsewhere" / "tokenizer.model")
    (ckpt / COMPLETE).write_text(complete_text(record))
    assert main(["convert", str(tmp_path / "mz"), str(tmp_path / "hf")]) == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "generation_config.json",
                                                                    "model.safetensors"]


def test_a_tokenizer_one_token_beyond_the_model_is_refused(tmp_path):
    """A tokenizer of exactly as many tokens as the model has rows exports; one more token would be
    an id the model cannot embed, and is refused before anything is written."""
    from tokenizers import Tokenizer, models

    from megazero.convert.hf_tokenizer import load_fitting
    from megazero.errors import UserError

    for words in (60, 61):
        Tokenizer(models.WordLevel({f"w{i}": i for i in range(words)} | {"</s>": words}, unk_token="</s>")).save(
            str(tmp_path / f"{words}.json"))
    assert load_fitting(str(tmp_path / "60.json"), 61, 16).tok.vocab_size == 61
    with pytest.raises(UserError, match="has 62 tokens, but the model has 61"):
        load_fitting(str(tmp_path / "61.json"), 61, 16)


def test_a_tokenizer_without_an_end_of_document_token_is_refused_for_export(tmp_path):
    """Such a tokenizer loads (preprocess --no-eod and training need no such token), but the exported
    config names one as eos_token_id: refused there, before anything is written, saying so.
    (Planted: the export's require_eod removed: a TypeError from the tokenizers library.)"""
    from tokenizers import Tokenizer, models

    from megazero.convert.hf_tokenizer import load_fitting
    from megazero.errors import UserError

    Tokenizer(models.WordLevel({"w0": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "bare.json"))
    with pytest.raises(UserError, match=r"--tokenizer .*bare\.json: .*bare\.json: no end-of-document token among "
                                        r"\[.*\] for the exported config's eos_token_id; add one"):
        load_fitting(str(tmp_path / "bare.json"), 8, 16)


def test_an_imported_folders_tokenizer_is_recorded_and_exported_back(tokenizers, tmp_path, capsys):
    """A Hugging Face folder's tokenizer came in without a word: the checkpoint recorded none, so a run
    from it took data of any tokenizer that fit, and an export back had no tokenizer. It is now the
    checkpoint's record and its data.tokenizer: another tokenizer is refused, and the export back
    encodes as it does. A folder without one imports with a note. (Planted: no record.)"""
    from megazero.checkpoint.format import latest_checkpoint
    from megazero.checkpoint.reader import CheckpointReader
    from megazero.data import not_trained_with

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      vocab_size=600, max_position_embeddings=16)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "bare")]) == 0
    assert "no tokenizer megazero can read" in capsys.readouterr().out
    (tmp_path / "hf" / "tokenizer.json").write_text(Path(tokenizers["json"]).read_text())
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "mz")]) == 0
    meta = CheckpointReader(latest_checkpoint(tmp_path / "mz")).meta
    assert meta["config"]["data"]["tokenizer"] == str((tmp_path / "hf" / "tokenizer.json").resolve())
    assert not_trained_with(meta, load_tokenizer(tokenizers["json"]), "data.tokenizer") is None
    refused = not_trained_with(meta, load_tokenizer(tokenizers["bpe"]), "data.tokenizer")
    assert refused is not None and "is not the tokenizer this checkpoint was trained with" in refused
    assert main(["convert", str(tmp_path / "mz"), str(tmp_path / "back"), "--to", "hf"]) == 0
    ours = load_tokenizer(tokenizers["json"])
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "back")
    assert [theirs.encode(t, add_special_tokens=False) for t in TEXTS] == [ours.encode(t) for t in TEXTS]


def test_an_import_says_what_its_tokenizer_and_config_add_around_a_text(tokenizers, tmp_path, capsys):
    """A folder whose tokenizer.json adds BOS to every text, and whose model ends a text with ids other
    than megazero's end-of-document token: both came in without a word, and `megazero generate` then
    fed prompts without the BOS and sampled past the model's own end of text. Each is a note now;
    a folder whose eos_token_id is the end-of-document token gets neither. (Planted: no notes.)"""
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      vocab_size=600, max_position_embeddings=16, eos_token_id=0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "plain")
    (tmp_path / "plain" / "tokenizer.json").write_text(Path(tokenizers["json"]).read_text())
    (tmp_path / "plain" / "generation_config.json").unlink(missing_ok=True)
    assert main(["convert", str(tmp_path / "plain"), str(tmp_path / "plain_mz")]) == 0
    assert "note:" not in capsys.readouterr().out

    config.eos_token_id = [0, 1]
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text(Path(tokenizers["json-bos"]).read_text())
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "mz")]) == 0
    out = capsys.readouterr().out
    assert "its post-processor puts <s> around every text, and megazero encodes without it" in out, out
    assert "which this model was trained to see; give `megazero generate` --prepend '<s>'" in out, out
    assert "the model ends a text with <|endoftext|> (0), <pad> (1) (eos_token_id), megazero's end-of-document " \
           "token is <|endoftext|> (0): `megazero generate` stops at that one alone unless given --stop-at '<pad>'" \
           in out, out
