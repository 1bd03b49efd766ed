"""`megazero.generate.sample` against a model whose next-token logits are known, so each rule of the
sampler is checked against a value computed here: the window the model reads, the position whose
logits give the next token, the top-k cut, the temperature's effect on the probabilities, and the seed."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megazero.generate import sample
from models.kv_cache import KVCache
from models import GPT
from models.config import ModelConfig
from models.presets import MODEL_PRESETS


class KnownLogits(torch.nn.Module):
    """Gives the same logits at every position, whatever the tokens, and records each window it is
    given: the sampler's own choices are then the only thing under test."""

    def __init__(self, logits: list[float], seq_length: int):
        super().__init__()
        self.logits = torch.tensor(logits)
        self.vocab_size = len(logits)
        self.cfg = SimpleNamespace(seq_length=seq_length)
        self.windows: list[list[int]] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.windows.append(tokens[0].tolist())
        return self.logits.expand(1, tokens.shape[1], -1)

    def decode(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        cache.advance(tokens.shape[1])
        return self(tokens)[:, -1]


def test_the_model_reads_the_last_seq_length_tokens():
    """Past ``seq_length`` tokens, each step feeds the model exactly the last ``seq_length`` tokens of
    the prompt and what was sampled so far: a window one short loses context the model was trained to
    use. Below it, the cache holds what was read: the prompt, then each drawn token alone."""
    model = KnownLogits([0.0, 0.0, 5.0], seq_length=4)
    out = sample(model, [0, 1, 0, 1, 0], 3, temperature=0)
    assert out == [0, 1, 0, 1, 0, 2, 2, 2]
    assert model.windows == [[1, 0, 1, 0], [0, 1, 0, 2], [1, 0, 2, 2]]
    model = KnownLogits([0.0, 0.0, 5.0], seq_length=4)
    assert sample(model, [0, 1], 4, temperature=0) == [0, 1, 2, 2, 2, 2]
    assert model.windows == [[0, 1], [2], [2], [1, 2, 2, 2]]


class Successor(torch.nn.Module):
    """Predicts at each position the id after the one there (mod the vocabulary), as a model whose
    logits do depend on the tokens: greedy decoding then counts on from the last token."""

    def __init__(self, vocab_size: int, seq_length: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.cfg = SimpleNamespace(seq_length=seq_length)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot((tokens + 1) % self.vocab_size, self.vocab_size).float()

    def decode(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        cache.advance(tokens.shape[1])
        return self(tokens)[:, -1]


def test_the_next_token_is_drawn_from_the_last_positions_logits():
    """The logits at the window's last position predict the next token; any other position's predict
    another token (here one already in the window)."""
    assert sample(Successor(5, seq_length=4), [0, 1, 2], 4, temperature=0) == [0, 1, 2, 3, 4, 0, 1]
    assert sample(Successor(5, seq_length=4), [0, 1, 2], 4, temperature=1.0, top_k=1) == [0, 1, 2, 3, 4, 0, 1]


def test_only_the_top_k_tokens_are_sampled():
    """At a temperature so high that every token is nearly as likely, top-k 2 still draws only the
    two likeliest ids (3 and 1 here)."""
    model = KnownLogits([0.0, 2.0, 1.0, 3.0, -1.0], seq_length=4)
    out = sample(model, [0], 400, temperature=100.0, top_k=2, seed=3)
    assert set(out[1:]) == {1, 3}


def test_the_temperature_divides_the_logits():
    """Logits 0 and ln 3 at temperature 2 give the second id probability sqrt(3) / (1 + sqrt(3)),
    about 0.634 (0.75 at temperature 1): its frequency over 4000 draws is within 0.03 of that
    (the standard deviation of the frequency is about 0.008)."""
    model = KnownLogits([0.0, math.log(3.0)], seq_length=4)
    out = sample(model, [0], 4000, temperature=2.0, top_k=2, seed=0)
    expected = math.sqrt(3.0) / (1.0 + math.sqrt(3.0))
    assert abs(sum(out[1:]) / 4000 - expected) < 0.03


def test_the_seed_picks_the_draws():
    """The same seed repeats a sample; another seed gives another (two 40-token draws among 4 equally
    likely ids agree by chance with probability 4**-40)."""
    model = KnownLogits([0.0, 0.0, 0.0, 0.0], seq_length=4)
    draws = {seed: sample(model, [0], 40, temperature=1.0, top_k=4, seed=seed) for seed in (1, 2)}
    assert draws[1] == sample(model, [0], 40, temperature=1.0, top_k=4, seed=1)
    assert draws[1] != draws[2]


def test_sampling_stops_at_the_end_of_the_document():
    """A model trained on documents each ended by EOD continues past it with the start of an unrelated
    document: sampling stops once ``stop`` is drawn (kept, so the caller sees why), and without one
    runs on. (Planted: the stop checked before the draw, or never.)"""
    assert sample(Successor(6, seq_length=4), [0], 10, temperature=0, stop={3}) == [0, 1, 2, 3]
    assert sample(Successor(6, seq_length=4), [0], 10, temperature=1.0, top_k=1, stop={3}) == [0, 1, 2, 3]
    assert sample(Successor(6, seq_length=4), [0], 4, temperature=0) == [0, 1, 2, 3, 4]
    assert sample(Successor(6, seq_length=4), [0], 2, temperature=0, stop={3}) == [0, 1, 2]


@pytest.mark.parametrize("preset", ["gpt2", "llama"])
def test_cached_greedy_draws_are_the_whole_forwards(preset):
    """With a real decoder (weights drawn large, so its logits depend strongly on each token's position
    and context), greedy draws through the KV cache, and past the context (8) through windows read
    afresh, are each the argmax of the whole forward over the last ``seq_length`` tokens: what the
    sampler did before it kept a cache. (Planted: learned positions or rotary angles counted from 0
    in each cached read.)"""
    fields = dict(MODEL_PRESETS[preset], num_layers=2, hidden_size=32, num_heads=4, vocab_size=50, seq_length=8,
                  init_std=0.5)
    model = GPT(ModelConfig(**fields), seed=2).eval()
    prompt = [3, 1, 4]
    expected = list(prompt)
    for _ in range(12):
        with torch.no_grad():
            logits = model(torch.tensor([expected[-8:]]))[0, -1, :50]
        expected.append(int(logits.argmax()))
    assert sample(model, list(prompt), 12, temperature=0) == expected


def test_the_cache_holds_what_the_draws_read(monkeypatch):
    """The cache is made for the prompt and the tokens drawn, not the whole context: an imported model's
    context of 131072 tokens is gigabytes of keys a layer, for a prompt of three words. (Planted: the
    cache sized to ``seq_length``.)"""
    import megazero.generate as generate

    made = []
    monkeypatch.setattr(generate, "KVCache", lambda capacity: made.append(capacity) or KVCache(capacity))
    sample(Successor(50, seq_length=4096), [0, 1, 2], 5, temperature=0)
    sample(Successor(50, seq_length=6), [0, 1, 2], 5, temperature=0)
    assert made == [8, 6]
