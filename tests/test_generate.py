"""`megazero generate`: a trained checkpoint loads into the single-device model and samples; bad
arguments are one-line errors naming the CHECKPOINT argument or the option, never checkpoint.load."""

from __future__ import annotations

import pytest
import torch

from megazero.cli import build_parser, main
from tests.distributed import run_world

VOCAB = 61


def _save_trained_checkpoint(rank, world_size, root, diverged=False):
    """What `megazero train` would leave after one step: a one-rank checkpoint with its config
    (``diverged``: with NaN in its master weights, as a run that diverged would save them)."""
    import torch.distributed as dist

    from megazero.checkpoint import CheckpointWriter
    from megazero.checkpoint.state import rank_files
    from megazero.config import load_config
    from megazero.config.loader import config_to_dict
    from megazero.engine import Engine
    from parallel.topology import RankGrid, Topology

    cfg = load_config(None, ["--model.num_layers", "2", "--model.hidden_size", "32", "--model.num_heads", "4",
                             "--model.vocab_size", str(VOCAB), "--model.seq_length", "16", "--train.device", "cpu",
                             "--train.micro_batch_size", "2", "--train.global_batch_size", "2"])
    engine = Engine(cfg, Topology(RankGrid(tp=1, pp=1, dp=1)), torch.device("cpu"))
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    engine.train_step([{"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}])
    if diverged:
        engine.optimizer.master[:5] = float("nan")
    CheckpointWriter(root, rank=0, world_size=1, barrier=dist.barrier).save(
        1, rank_files(engine.chunks, engine.optimizer, 0), meta={"config": config_to_dict(cfg)})
    return {name: p.detach().numpy().copy() for name, p in engine.chunks[0].named_parameters()}  # by value


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate") / "checkpoints"
    weights = run_world(1, _save_trained_checkpoint, str(root))[0]
    return root, weights


def _tokenizer(path, words: int) -> str:
    """A word-level tokenizer.json: "w0".."w{words-1}" and the end-of-document token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(words)}
    vocab["</s>"] = words
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return str(path)


def test_the_model_holds_the_trained_weights(trained):
    from megazero.generate import load_model

    root, weights = trained
    model, cfg = load_model(root)
    assert cfg.model.vocab_size == VOCAB
    assert not model.training  # a model trained with dropout samples and converts without it
    loaded = dict(model.named_parameters())
    assert set(loaded) == set(weights)
    for name, value in weights.items():
        assert torch.equal(loaded[name], torch.from_numpy(value)), name


def test_the_command_samples_greedily(trained, tmp_path, capsys):
    tok = _tokenizer(tmp_path / "tokenizer.json", VOCAB - 1)
    args = ["generate", str(trained[0]), "--tokenizer", tok, "--prompt", "w1 w2 w3", "--temperature", "0"]
    assert main([*args, "--tokens", "5"]) == 0
    words = capsys.readouterr().out.split()
    assert words[:3] == ["w1", "w2", "w3"] and len(words) == 8
    assert main([*args, "--tokens", "0"]) == 0
    assert capsys.readouterr().out.split() == ["w1", "w2", "w3"]


def _greedy_without_cache(model, tokens: list[int], new_tokens: int) -> list[int]:
    """The reference the cached sampler must give: each token the argmax of a whole forward over the
    last ``seq_length`` tokens."""
    for _ in range(new_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([tokens[-model.cfg.seq_length:]]))[0, -1, :model.vocab_size]
        tokens = [*tokens, int(logits.argmax())]
    return tokens


def test_the_cached_draws_are_the_whole_forwards(trained, tmp_path, capsys):
    """The command reads the prompt once and each drawn token alone (a KV cache) while they fit the
    context (16), then the last 16 afresh: its greedy text is the one each draw's whole forward
    gives, across that change (3 + 20 tokens). (Planted: each read the last token alone, the prompt
    never read. Positions are checked where they move the draws: test_generate_sampling.py.)"""
    from megazero.generate import load_model

    tok = _tokenizer(tmp_path / "tokenizer.json", VOCAB - 1)
    assert main(["generate", str(trained[0]), "--tokenizer", tok, "--prompt", "w1 w2 w3", "--temperature", "0",
                 "--tokens", "20", "--past-eod", "--device", "cpu"]) == 0
    words = capsys.readouterr().out.split()
    expected = _greedy_without_cache(load_model(trained[0])[0], [1, 2, 3], 20)
    assert words == ["</s>" if i == VOCAB - 1 else f"w{i}" for i in expected]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16_bit_weights_draw_the_whole_forwards_of_16_bit_weights(trained, tmp_path, capsys, dtype):
    """``--dtype`` rounds the master weights to 16 bits (a tied head stays the embedding, the rotary
    tables stay fp32): the greedy text through the cache is the one each draw's whole forward of
    those weights gives."""
    from megazero.generate import DTYPES, load_opened, open_checkpoint

    tok = _tokenizer(tmp_path / "tokenizer.json", VOCAB - 1)
    assert main(["generate", str(trained[0]), "--tokenizer", tok, "--prompt", "w1 w2 w3", "--temperature", "0",
                 "--tokens", "20", "--past-eod", "--device", "cpu", "--dtype", dtype]) == 0
    words = capsys.readouterr().out.split()
    model, _ = load_opened(open_checkpoint(trained[0]), DTYPES[dtype])
    assert {p.dtype for p in model.parameters()} == {DTYPES[dtype]}
    assert model.lm_head.weight is model.embedding.tokens.weight or not model.cfg.tie_embeddings
    expected = _greedy_without_cache(model, [1, 2, 3], 20)
    assert words == ["</s>" if i == VOCAB - 1 else f"w{i}" for i in expected]


def test_weights_past_fp16s_range_are_refused_in_fp16(trained, tmp_path, capsys, monkeypatch):
    """A weight of 1e6 rounds to inf in fp16, and inf logits would be drawn as token 0: one line."""
    import megazero.generate as generate

    load = generate.load_full_weights

    def with_a_large_weight(*args):
        weights = load(*args)
        weights["final_norm.weight"] = weights["final_norm.weight"] * 0 + 1e6
        return weights

    monkeypatch.setattr(generate, "load_full_weights", with_a_large_weight)
    tok = _tokenizer(tmp_path / "tokenizer.json", VOCAB - 1)
    args = ["generate", str(trained[0]), "--tokenizer", tok, "--prompt", "w1", "--tokens", "2", "--device", "cpu"]
    err = _error_line(capsys, [*args, "--dtype", "fp16"])
    assert "parameter 'final_norm.weight' holds values past fp16's range; sample in bf16 or fp32" in err, err
    assert main([*args, "--dtype", "bf16"]) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_a_device_that_is_not_here_is_one_line(trained, tmp_path, capsys):
    """``--device cuda`` on a machine without a GPU, or a name torch does not read, is refused in one
    line naming the option, before the weights are read. (Planted: no check; CUDA's own error.)"""
    tok = _tokenizer(tmp_path / "tokenizer.json", VOCAB - 1)
    args = ["generate", str(trained[0]), "--tokenizer", tok, "--prompt", "w1"]
    err = _error_line(capsys, [*args, "--device", "cuda"])
    assert err == "megazero generate: error: --device cuda: this machine has no GPU torch can use; use --device cpu"
    for name in ("gpu", "cuda:x"):
        err = _error_line(capsys, [*args, "--device", name])
        assert err == f"megazero generate: error: --device {name!r}: not a device; use cpu, cuda or cuda:N", err
    err = _error_line(capsys, [*args, "--device", "meta"])
    assert err == "megazero generate: error: --device 'meta': megazero samples on cpu or cuda only; use cpu, cuda or cuda:N"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sampling_on_the_gpu_gives_the_cpus_text(trained, tmp_path, capsys):
    """The model on the GPU, the draws on the CPU: greedy and seeded samples are the CPU's text (the
    demo model's likeliest tokens are far apart, so rounding does not change them)."""
    tok = _tokenizer(tmp_path / "tokenizer.json", VOCAB - 1)
    args = ["generate", str(trained[0]), "--tokenizer", tok, "--prompt", "w1 w2 w3", "--tokens", "20", "--past-eod"]
    for flags in (["--temperature", "0"], ["--temperature", "1", "--seed", "3"]):
        texts = []
        for device in ("cpu", "cuda"):
            assert main([*args, *flags, "--device", device]) == 0
            texts.append(capsys.readouterr().out)
        assert texts[0] == texts[1], (flags, texts)


def test_the_command_samples_by_its_seed_and_top_k(trained, tmp_path, capsys):
    """``--seed`` picks the draw (the same seed, the same text; other seeds, other text) and ``--top-k 1``
    leaves only the likeliest token, so sampling at temperature 1 is then greedy decoding."""
    tok = _tokenizer(tmp_path / "tokenizer.json", VOCAB - 1)
    args = ["generate", str(trained[0]), "--tokenizer", tok, "--prompt", "w1 w2 w3", "--tokens", "8"]

    def text(*flags):
        assert main([*args, *flags]) == 0
        return capsys.readouterr().out

    drawn = [text("--temperature", "1", "--seed", str(seed)) for seed in (1, 2, 3, 4)]
    assert drawn[0] == text("--temperature", "1", "--seed", "1") and len(set(drawn)) > 1, drawn
    assert text("--temperature", "1", "--top-k", "1", "--seed", "5") == text("--temperature", "0")


def test_a_prompt_longer_than_the_context_is_noted(trained, tmp_path, capsys):
    """The model (seq_length 16) reads only the last 16 of a 20-token prompt; the text printed is
    the whole prompt and its continuation, so a line on stderr says what was read (and nothing is
    said of a prompt that fits with what is drawn, nor where no token is sampled and the model reads
    nothing). A prompt that fits, but not with the tokens drawn, slides out of view: said too (it was
    not). (Planted: only the prompt's length looked at.)"""
    tok = _tokenizer(tmp_path / "tokenizer.json", VOCAB - 1)
    args = ["generate", str(trained[0]), "--tokenizer", tok, "--temperature", "0", "--tokens", "2"]
    assert main([*args, "--prompt", " ".join(f"w{i}" for i in range(20))]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.split()) == 22
    assert captured.err.splitlines() == ["note: --prompt is 20 tokens, more than the model's context of 16 "
                                         "(model.seq_length); only its last 16 tokens are read"]
    exact = " ".join(f"w{i}" for i in range(16))
    assert main([*args, "--tokens", "1", "--prompt", exact]) == 0  # exactly the context: read whole
    assert capsys.readouterr().err == ""
    assert main([*args, "--prompt", exact]) == 0  # the second draw reads the last 16 of 17: the prompt slides
    assert capsys.readouterr().err.splitlines() == [
        "note: the model's context is 16 tokens (model.seq_length): from token 2 drawn on, it reads the last 16 "
        "alone and the prompt's start slides out of view"]
    assert main([*args, "--tokens", "0", "--prompt", " ".join(f"w{i}" for i in range(20))]) == 0  # nothing read
    assert capsys.readouterr().err == ""
    # the --prepend tokens are read first, so they are the first not read (planted: counted as prompt)
    assert main([*args, "--prepend", "w0", "--prepend", "w1", "--prompt", " ".join(f"w{i}" for i in range(15))]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "note: --prepend and --prompt are 17 tokens, more than the model's context of 16 (model.seq_length); only "
        "the last 16 are read, not the first --prepend token"]
    assert main([*args, "--prepend", "w0", "--prompt", " ".join(f"w{i}" for i in range(15))]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "note: the model's context is 16 tokens (model.seq_length): from token 2 drawn on, it reads the last 16 "
        "alone and the --prepend tokens, then the prompt's start, slide out of view"]


@pytest.mark.parametrize("option, value, words", [
    ("--tokens", "-1", "argument --tokens: must be 0 or more, got -1"),
    ("--tokens", "many", "argument --tokens: 'many' is not an integer"),
    ("--top-k", "0", "argument --top-k: must be 1 or more, got 0"),
    ("--seed", "99999999999999999999", "argument --seed: must be below 9223372036854775808"),
    ("--seed", str(2**63), "argument --seed: must be below 9223372036854775808, got 9223372036854775808"),
    ("--seed", "-1", "argument --seed: must be 0 or more"),
    ("--temperature", "inf", "argument --temperature: must be a finite number of 0 or more, got inf"),
    ("--temperature", "-0.5", "argument --temperature: must be a finite number of 0 or more, got -0.5"),
])
def test_bad_numbers_are_refused_by_the_parser(capsys, option, value, words):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["generate", "ckpt", "--tokenizer", "t.model", option, value])
    assert exit_info.value.code == 2
    assert words in capsys.readouterr().err


def _error_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert "checkpoint.load" not in err
    return err.strip()


def test_checkpoint_errors_name_the_checkpoint_argument(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    err = _error_line(capsys, ["generate", str(missing), "--tokenizer", "t.model"])
    assert err == f"megazero generate: error: {missing}: checkpoint path does not exist; check the CHECKPOINT argument"
    err = _error_line(capsys, ["generate", str(tmp_path), "--tokenizer", "t.model"])
    assert err.endswith("holds no complete checkpoint (step_* directory with a COMPLETE marker); check the "
                        "CHECKPOINT argument")
    (tmp_path / "step_0000003").mkdir()
    err = _error_line(capsys, ["generate", str(tmp_path / "step_0000003"), "--tokenizer", "t.model"])
    assert "step_0000003: not a complete checkpoint" in err


def test_a_tokenizer_beyond_the_models_vocabulary_is_named(trained, tmp_path, capsys):
    tok = _tokenizer(tmp_path / "tokenizer.json", 100)
    err = _error_line(capsys, ["generate", str(trained[0]), "--tokenizer", tok, "--prompt", "w9"])
    assert err.endswith(f"--tokenizer {tok}: has 101 tokens, but the checkpoint's model has {VOCAB}; use the "
                        "tokenizer it was trained with")
    one_more = _tokenizer(tmp_path / "one_more.json", VOCAB)  # VOCAB words and </s>: one id beyond the rows
    err = _error_line(capsys, ["generate", str(trained[0]), "--tokenizer", one_more, "--prompt", "w9"])
    assert err.endswith(f"has {VOCAB + 1} tokens, but the checkpoint's model has {VOCAB}; use the tokenizer it "
                        "was trained with")
    small = _tokenizer(tmp_path / "small.json", 10)
    err = _error_line(capsys, ["generate", str(trained[0]), "--tokenizer", small, "--prompt", ""])
    assert err.endswith("--prompt '' encodes to no tokens; give some text to continue "
                        "(or --prepend the token the model's texts open with)")


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    root = tmp_path_factory.mktemp("diverged") / "checkpoints"
    run_world(1, _save_trained_checkpoint, str(root), True)
    return root


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_a_checkpoint_with_nan_weights_is_refused(diverged, tmp_path, capsys, temperature):
    """NaN weights make every logit NaN: greedy decoding printed token 0 over and over as if the model
    chose it, and sampling stopped with torch.multinomial's traceback. The load names the checkpoint
    and the parameter instead."""
    root = diverged
    tok = _tokenizer(tmp_path / "tokenizer.json", VOCAB - 1)
    err = _error_line(capsys, ["generate", str(root), "--tokenizer", tok, "--prompt", "w1 w2", "--tokens", "3",
                               "--temperature", temperature])
    assert err.startswith(f"megazero generate: error: {root / 'step_0000001'}: parameter ")
    assert "holds 5 NaN or infinite values" in err


def test_a_too_large_tokenizer_is_refused_before_the_weights_are_read(trained, tmp_path, capsys, monkeypatch):
    """Reading and verifying a large model's weights takes minutes; the vocabulary the model was
    trained with is in the checkpoint's manifest, so the refusal comes first (it came after the load)."""
    import megazero.generate

    reads = []
    monkeypatch.setattr(megazero.generate, "load_full_weights", lambda *args: reads.append(args))
    tok = _tokenizer(tmp_path / "tokenizer.json", 100)
    err = _error_line(capsys, ["generate", str(trained[0]), "--tokenizer", tok, "--prompt", "w9"])
    assert err.endswith("use the tokenizer it was trained with") and reads == []


def test_the_command_reads_the_checkpoints_record_once(trained, tmp_path, capsys, monkeypatch):
    """The tokenizer check, the vocabulary check, the config and the weights' checksums all come from
    one read of ``COMPLETE`` (planted: each re-read it, four reads, and a directory replaced between
    them gave a config from one checkpoint and weights from another)."""
    from megazero.checkpoint import format

    read_json, reads = format.read_json, []

    def counting(path, what):
        reads.append(path.name)
        return read_json(path, what)

    monkeypatch.setattr(format, "read_json", counting)
    tok = _tokenizer(tmp_path / "tokenizer.json", VOCAB - 1)
    assert main(["generate", str(trained[0]), "--tokenizer", tok, "--prompt", "w1", "--tokens", "1"]) == 0
    assert reads == ["COMPLETE"], reads


def test_a_checkpoint_replaced_after_it_was_read_is_refused(trained, diverged, tmp_path, capsys, monkeypatch):
    """A training run re-saving the step swaps its directory: once generate has read the record, the
    weights found there are refused by their checksums, never taken for the record's (planted: the
    weights' reader read the new record, and loaded the other checkpoint's weights)."""
    import shutil

    import megazero.generate

    root = tmp_path / "checkpoints"
    shutil.copytree(trained[0], root)
    load = megazero.generate.load_full_weights

    def replaced_first(ckpt, *args):
        shutil.rmtree(ckpt)
        shutil.copytree(diverged / ckpt.name, ckpt)
        return load(ckpt, *args)

    monkeypatch.setattr(megazero.generate, "load_full_weights", replaced_first)
    tok = _tokenizer(tmp_path / "tokenizer.json", VOCAB - 1)
    err = _error_line(capsys, ["generate", str(root), "--tokenizer", tok, "--prompt", "w1", "--tokens", "1"])
    assert "does not match the manifest's" in err and "the file is corrupted" in err, err


def test_a_rank_file_replaced_after_its_check_is_refused(trained, diverged, tmp_path, capsys, monkeypatch):
    """The weights are read one tensor per opening of the rank file: once it is hashed, a training
    run re-saving the step (here: the diverged checkpoint's file of the same size renamed over it) is
    refused at the next opening (planted: each opening read the path again unchecked, and generated
    from the other checkpoint's weights, or stopped at their NaN as if they were this one's)."""
    import os
    import shutil

    from megazero.checkpoint import format

    root = tmp_path / "checkpoints"
    shutil.copytree(trained[0], root)
    path, other = root / "step_0000001" / "rank_00000.safetensors", diverged / "step_0000001" / "rank_00000.safetensors"
    assert path.stat().st_size == other.stat().st_size
    digest = format.file_digest

    def hashing_then_replacing(f):
        result = digest(f)
        if f.name == str(path) and other.exists():
            shutil.copy(other, path.with_name("new"))
            os.replace(path.with_name("new"), path)
        return result

    monkeypatch.setattr(format, "file_digest", hashing_then_replacing)
    tok = _tokenizer(tmp_path / "tokenizer.json", VOCAB - 1)
    err = _error_line(capsys, ["generate", str(root), "--tokenizer", tok, "--prompt", "w1", "--tokens", "1"])
    assert err == f"megazero generate: error: {path}: the checkpoint changed while it was read (this file was " \
                  "replaced or rewritten after its sha256 was checked); load it again once nothing writes to it, " \
                  "or load an earlier checkpoint", err


@pytest.mark.parametrize("config", [None, "configs/gpt_1.3b.yaml"])
def test_a_checkpoint_without_its_training_config_names_the_checkpoint_argument(trained, tmp_path, capsys, config):
    """A record with no training config, or one no run writes (a file name), leaves nothing to build the
    model from: one line naming the directory and the CHECKPOINT argument (planted: only a missing
    config checked, a traceback; the default 'checkpoint path' named)."""
    import json
    import shutil

    from megazero.checkpoint import latest_checkpoint
    from megazero.checkpoint.format import CHECKSUM, complete_text

    shutil.copytree(trained[0], tmp_path / "checkpoints")
    ckpt = latest_checkpoint(tmp_path / "checkpoints")
    record = json.loads((ckpt / "COMPLETE").read_text())
    record.pop(CHECKSUM)
    record["meta"]["config"] = config
    (ckpt / "COMPLETE").write_text(complete_text(record))
    tok = _tokenizer(tmp_path / "tokenizer.json", VOCAB - 1)
    err = _error_line(capsys, ["generate", str(tmp_path / "checkpoints"), "--tokenizer", tok, "--prompt", "w1"])
    assert err == (f"megazero generate: error: {ckpt}: records no training config, so it was not saved by "
                   "`megazero train`; check the CHECKPOINT argument"), err


def test_a_smaller_tokenizer_samples_only_what_it_can_decode(trained, tmp_path, capsys):
    """A model may have more rows than its tokenizer has pieces (a vocabulary set above the tokenizer's):
    sampling stays among the ids the tokenizer decodes (it sampled the others, and decoding failed)."""
    small = _tokenizer(tmp_path / "small.json", 10)
    assert main(["generate", str(trained[0]), "--tokenizer", small, "--prompt", "w1 w2", "--tokens", "40",
                 "--temperature", "5", "--top-k", str(VOCAB), "--past-eod"]) == 0
    words = capsys.readouterr().out.split()
    assert len(words) >= 30 and set(words) <= {f"w{i}" for i in range(10)} | {"</s>"}, words


def test_ids_between_a_tokenizers_tokens_are_not_sampled(trained, tmp_path, capsys):
    """A tokenizer.json whose ids leave a gap (w0..w9, then its end-of-document token far above them):
    the ids in the gap were sampled and decoded to nothing, the text silently shorter than the count
    drawn. Every id drawn now decodes. (Planted: sampling among every id below the largest.)"""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {**{f"w{i}": i for i in range(10)}, "</s>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "gap.json"))
    assert main(["generate", str(trained[0]), "--tokenizer", str(tmp_path / "gap.json"), "--prompt", "w1 w2",
                 "--tokens", "40", "--temperature", "5", "--top-k", str(VOCAB), "--past-eod"]) == 0
    words = capsys.readouterr().out.split()
    assert len(words) == 42 and set(words) <= {f"w{i}" for i in range(10)} | {"</s>"}, words


def test_the_command_stops_at_the_end_of_the_document(trained, tmp_path, capsys):
    """What follows the end-of-document token was trained as the start of an unrelated document: the
    command stops there, says so on stderr, and ``--past-eod`` samples on. (Planted: no stop.)"""
    small = _tokenizer(tmp_path / "small.json", 10)
    args = ["generate", str(trained[0]), "--tokenizer", small, "--prompt", "w1 w2", "--tokens", "40",
            "--temperature", "5", "--top-k", str(VOCAB)]
    assert main(args) == 0
    captured = capsys.readouterr()
    words = captured.out.split()
    assert words[-1] == "</s>" and words.count("</s>") == 1 and len(words) < 42, words
    assert f"note: the document ended after {len(words) - 2} of 40 tokens" in captured.err, captured.err
    assert main([*args, "--past-eod"]) == 0
    assert len(capsys.readouterr().out.split()) == 42


def test_prepended_tokens_are_read_and_not_printed(trained, tmp_path, capsys):
    """``--prepend`` puts named tokens before the prompt (the BOS an imported model opened every text
    with): the model reads them, so the greedy continuation is the one of the prompt with them written
    out, and the text printed is the prompt and its continuation alone. With them, an empty prompt is
    a start to continue from. (Planted: the tokens left out of what the model reads; printed.)"""
    tok = _tokenizer(tmp_path / "tokenizer.json", VOCAB - 1)
    args = ["generate", str(trained[0]), "--tokenizer", tok, "--temperature", "0", "--tokens", "12", "--past-eod"]

    def text(*flags):
        assert main([*args, *flags]) == 0
        return capsys.readouterr().out.split()

    written_out = text("--prompt", "w7 w7 w1 w2")
    assert text("--prepend", "w7", "--prepend", "w7", "--prompt", "w1 w2") == written_out[2:]
    assert text("--prepend", "w7", "--prompt", "") == text("--prompt", "w7")[1:]
    assert text("--prompt", "w1 w2") != written_out[2:]  # what was prepended changes the continuation


def test_sampling_stops_at_a_named_token(trained, tmp_path, capsys):
    """``--stop-at`` ends the sample at the first drawn token it names (an imported model's end-of-turn
    id, which is not megazero's end of document), printed, and a note says so; a name the tokenizer
    lacks is one line naming the option. (Planted: the named tokens not passed to the sampler.)"""
    tok = _tokenizer(tmp_path / "tokenizer.json", VOCAB - 1)
    args = ["generate", str(trained[0]), "--tokenizer", tok, "--prompt", "w1 w2", "--temperature", "0",
            "--tokens", "20", "--past-eod"]
    assert main(args) == 0
    drawn = capsys.readouterr().out.split()[2:]
    first = next(word for i, word in enumerate(drawn) if i and word not in drawn[:i])  # a later first draw
    assert main([*args, "--stop-at", first]) == 0
    captured = capsys.readouterr()
    stopped = drawn[:drawn.index(first) + 1]
    assert captured.out.split() == ["w1", "w2", *stopped], (captured.out, drawn)
    assert f"note: stopped at {first} (--stop-at) after {len(stopped)} of 20 tokens" in captured.err, captured.err
    err = _error_line(capsys, [*args, "--stop-at", "w1", "--stop-at", "<eot>"])
    assert err == (f"megazero generate: error: --stop-at '<eot>': no such token in --tokenizer {tok}; name one of "
                   "its tokens exactly as its vocabulary spells it"), err
    err = _error_line(capsys, [*args, "--prepend", "<s>"])
    assert err.startswith("megazero generate: error: --prepend '<s>': no such token"), err


def test_a_vanishing_temperature_samples_the_likeliest_token(trained, tmp_path, capsys):
    """A temperature so small that logits / temperature overflows (1e-45) is the greedy choice, not a
    crash on infinite probabilities (planted: dividing before taking the largest out), and so is one
    that float32 cannot hold (planted: the division in float32, 0 / 0 for the largest)."""
    tok = _tokenizer(tmp_path / "tokenizer.json", VOCAB - 1)
    args = ["generate", str(trained[0]), "--tokenizer", tok, "--prompt", "w1 w2", "--tokens", "6"]
    assert main([*args, "--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    for tiny in ("1e-45", "1e-50", "5e-324"):  # below float32's range, then the smallest float64
        assert main([*args, "--temperature", tiny]) == 0
        assert capsys.readouterr().out == greedy, tiny


@pytest.mark.parametrize("stop, status, said", [(KeyboardInterrupt, 130, "interrupted"),
                                                ("Terminated", 143, "stopped by SIGTERM")])
def test_a_stopped_run_prints_what_it_sampled(trained, tmp_path, capsys, monkeypatch, stop, status, said):
    """Ctrl-C or SIGTERM in the middle of a long --tokens run prints the text sampled so far before
    the command stops (planted: it printed nothing, and minutes of sampling were lost), and says
    how far it got on stderr."""
    from megazero import cli
    from models import GPT

    stop = getattr(cli, stop) if isinstance(stop, str) else stop
    decode, calls = GPT.decode, []

    def stopping_decode(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # three tokens sampled (within the context: each read through the cache)
            raise stop
        return decode(self, *args, **kwargs)

    tok = _tokenizer(tmp_path / "tokenizer.json", VOCAB - 1)
    args = ["generate", str(trained[0]), "--tokenizer", tok, "--prompt", "w1 w2", "--temperature", "0"]
    assert main([*args, "--tokens", "3"]) == 0
    three = capsys.readouterr().out
    monkeypatch.setattr(GPT, "decode", stopping_decode)
    assert main([*args, "--tokens", "1000"]) == status
    captured = capsys.readouterr()
    assert captured.out == three
    assert captured.err.splitlines()[-2:] == ["note: stopped after 3 of 1000 tokens", f"megazero generate: {said}"]
