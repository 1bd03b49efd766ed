"""Decoding with a ``KVCache`` computes what the whole forward does, a token or a chunk at a time.

The cached forward reads the new tokens alone, at positions after those the cache holds: learned
positions, rotary angles and the causal mask must all count from there. fp32 on CPU; the products
run on other shapes than the whole forward's, so the logits agree to rounding (2e-5 relative), and
a position off by one moves them by far more (about 1e-1 at these sizes).
"""

import pytest
import torch

from models import GPT
from models.config import ModelConfig
from models.kv_cache import KVCache
from models.presets import MODEL_PRESETS

RTOL = 2e-5


def config(preset: str) -> ModelConfig:
    fields = dict(MODEL_PRESETS[preset], num_layers=3, hidden_size=64, num_heads=4, vocab_size=300, seq_length=16)
    if preset == "llama":
        fields["num_kv_heads"] = 2  # grouped-query attention: two query heads read each key/value head
    return ModelConfig(**fields)


def model_and_text(preset: str, batch: int = 2, device: str = "cpu") -> tuple[ModelConfig, GPT, torch.Tensor]:
    """A small model of ``preset`` and a random text [batch, seq_length] in its vocabulary."""
    cfg = config(preset)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=torch.Generator().manual_seed(1))
    return cfg, GPT(cfg, seed=5).eval().to(device), ids.to(device)


def assert_close(cached: torch.Tensor, whole: torch.Tensor, rtol: float = RTOL) -> None:
    error = (cached - whole).abs().max().item()
    assert error <= rtol * whole.abs().max().item(), error


@pytest.mark.parametrize("chunks", [[16], [5, 1, 1, 1, 3, 1, 4], [1] * 16], ids=["at once", "mixed", "one by one"])
@pytest.mark.parametrize("preset", ["gpt2", "llama"])
def test_cached_chunks_give_the_whole_forwards_logits(preset, chunks):
    """The logits after each chunk read after what the cache holds (a prompt, then drawn tokens one at
    a time, and chunks of several, whose queries must not see each other's later tokens) equal the
    whole sequence's causal forward at that position; the cache then holds every position.
    (Planted: positions or rotary angles counted from 0 in each chunk; the mask aligned to the
    chunk's first key, as SDPA's ``is_causal`` does.)"""
    cfg, model, ids = model_and_text(preset)
    with torch.no_grad():
        whole = model(ids)
    cache = KVCache(cfg.seq_length)
    ends = torch.tensor(chunks).cumsum(0)
    cached = torch.stack([model.decode(ids[:, end - size:end], cache) for size, end in zip(chunks, ends)], dim=1)
    assert cache.length == cfg.seq_length
    assert_close(cached, whole[:, ends - 1])


@pytest.mark.parametrize("preset", ["gpt2", "llama"])
def test_a_cache_refuses_positions_past_its_capacity(preset):
    """Learned positions and rotary tables end at ``seq_length``: a token past it has no position the
    model was trained on, so the cache says so rather than growing, before anything is read (the
    learned table's own IndexError came first); so does a cache made smaller, for what decoding will
    read, past its end."""
    cfg = config(preset)
    model = GPT(cfg, seed=5).eval()
    cache = KVCache(cfg.seq_length)
    model.decode(torch.zeros(1, cfg.seq_length - 1, dtype=torch.long), cache)
    model.decode(torch.zeros(1, 1, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="a KV cache of 16 positions cannot take positions 16..16"):
        model.decode(torch.zeros(1, 1, dtype=torch.long), cache)
    small = KVCache(5)
    model.decode(torch.zeros(1, 3, dtype=torch.long), small)
    with pytest.raises(ValueError, match="a KV cache of 5 positions cannot take positions 3..5"):
        model.decode(torch.zeros(1, 3, dtype=torch.long), small)
    assert small.length == 3 and small.layer("0").keys.shape[2] == 5  # the layers hold only what was asked


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, RTOL), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("preset", ["gpt2", "llama"])
def test_a_position_held_on_the_device_gives_the_same_logits(preset, dtype, rtol):
    """A CUDA graph's decode reads the position from a tensor (``KVCache.position``), writes keys and
    values at it and attends over the whole cache under a causal mask: here on the CPU, with stale
    keys left past the position, each one-token step after a prompt equals the whole forward.
    Positions never written hold zeros: a masked key weighs 0, but its value still enters the
    product, and unwritten bf16 memory held NaNs that made every logit NaN. (Planted: the mask not
    made for one query, so the stale keys were read; the learned or rotary positions taken from the
    host count; the buffers made uninitialised.)"""
    cfg, model, ids = model_and_text(preset)
    model.to(dtype)
    with torch.no_grad():
        whole = model(ids)
        cache = KVCache(cfg.seq_length)
        model.decode(ids[:, :5], cache)
        for layer in cache._layers.values():
            assert not layer.keys[:, :, 5:].any() and not layer.values[:, :, 5:].any()
            layer.keys[:, :, 5:9] = 100.0  # what a warm-up or an earlier text left there
            layer.values[:, :, 5:9] = -100.0
        cache.position = torch.tensor(5)
        steps = []
        for end in range(6, cfg.seq_length + 1):
            cache.position.fill_(cache.length)
            cache.length = 0  # a host count the device path must not read (it is restored below)
            steps.append(model.decode(ids[:, end - 1:end], cache))
            cache.length = end
    assert_close(torch.stack(steps, dim=1).float(), whole[:, 5:].float(), rtol)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("preset", ["gpt2", "llama"])
def test_a_decode_graphs_replays_give_the_whole_forwards_logits(preset, dtype, rtol):
    """Each replay of a ``DecodeGraph`` (the GPU's fused kernels, captured after a prompt) reads its
    own token at its own position: its logits equal the whole forward's at every step, in fp32 and
    in bf16 (``generate --dtype``), and the cache counts each position once."""
    from models.decode_graph import DecodeGraph

    cfg, model, ids = model_and_text(preset, batch=1, device="cuda")
    model.to(dtype)
    with torch.no_grad():
        whole = model(ids)
        cache = KVCache(cfg.seq_length)
        model.decode(ids[:, :5], cache)
        graph = DecodeGraph(model, cache, batch=1, device=ids.device)
        assert cache.length == 5
        steps = [graph(ids[:, end - 1:end]).clone() for end in range(6, cfg.seq_length + 1)]
    assert cache.length == cfg.seq_length
    assert_close(torch.stack(steps, dim=1).float(), whole[:, 5:].float(), rtol=rtol)
