"""The model's layers against their textbook definitions, read off the weights as the modules lay them out.

The tensor-parallel equivalence tests compare a split model with the plain one built from the same
code, so a layout or formula wrong in both (keys read as values, the rotation left off the keys, the
gate read as the up projection) passes there; here each layer is recomputed from its weights alone.
Likewise the config's derived widths and defaults, the vocabulary padding and what the gpt2 preset
builds, which reach both models alike. fp32 on CPU, compared at 1e-5 relative to the largest value.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from models import GPT, ops
from models.attention import AttentionCore
from models.config import ModelConfig
from models.embedding import fit_rows, padded_vocab_size
from models.mlp import MLP
from models.norms import LayerNorm, build_norm
from tests.test_model_gpt import config as gpt_config

RTOL = 1e-5


def config(preset: str, **overrides) -> ModelConfig:
    """``test_model_gpt``'s configs, one small block."""
    return gpt_config(preset, **{"num_layers": 1, "hidden_size": 32, "vocab_size": 100, "seq_length": 8, **overrides})


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() <= RTOL * b.abs().max().item()


def _block(cfg: ModelConfig):
    """Block 0 of a model of ``cfg``, its biases random (initialised to zero, they would hide their layout)."""
    block = GPT(cfg, seed=3).layers["0"]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in block.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=g))
    return block


def _textbook_attention(attention, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Query head h reads key/value head h // r (r query heads per group): per kv head g, the fused
    projection's rows hold r query heads, then k_g, then v_g; under rope q and k (only) are rotated."""
    d, r, seq = cfg.head_dim, cfg.num_heads // cfg.kv_heads, x.shape[1]
    weight = attention.qkv.weight.view(cfg.kv_heads, r + 2, d, cfg.hidden_size)
    bias = attention.qkv.bias.view(cfg.kv_heads, r + 2, d)
    cos, sin = ops.rotary_tables(seq, d, cfg.rope_theta, "cpu", torch.float32)
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    heads = []
    for h in range(cfg.num_heads):
        g, j = divmod(h, r)
        q, k, v = (x @ weight[g, i].t() + bias[g, i] for i in (j, r, r + 1))
        if cfg.position_embedding == "rope":
            q, k = (ops.apply_rotary(t[:, :, None], cos, sin)[:, :, 0] for t in (q, k))
        scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(causal, float("-inf"))
        heads.append(scores.softmax(-1) @ v)
    return attention.out(torch.cat(heads, -1))


@pytest.mark.parametrize("preset", ["gpt2", "llama"])
def test_attention_is_textbook_grouped_query_attention(preset):
    """Keys read as values, keys left unrotated, or rotary added under learned positions would each be
    in the reference model as well, so only a computation from the weights alone shows them."""
    cfg = config(preset, bias=True)
    attention = _block(cfg).attention
    x = torch.randn(2, cfg.seq_length, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert close(attention(x), _textbook_attention(attention, x, cfg))


@pytest.mark.parametrize("preset, activation", [("gpt2", "gelu"), ("gpt2", "gelu_exact"), ("llama", "swiglu")])
def test_mlp_is_tanh_or_exact_gelu_or_swiglu_over_interleaved_gate_and_up_rows(preset, activation):
    cfg = config(preset, bias=True, activation=activation)
    mlp = _block(cfg).mlp
    x = 4 * torch.randn(2, cfg.seq_length, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    h = mlp.fc_in(x)
    if activation == "swiglu":
        gate, up = h[..., 0::2], h[..., 1::2]  # rows gate_0, up_0, gate_1, up_1, ...
        expected = mlp.fc_out(F.silu(gate) * up)
    else:
        expected = mlp.fc_out(F.gelu(h, approximate="tanh" if activation == "gelu" else "none"))
    with torch.no_grad():
        assert close(mlp(x), expected)


@pytest.mark.parametrize("kind,bias", [("layernorm", True), ("layernorm", False), ("rmsnorm", True)])
def test_norms_use_the_configs_epsilon_and_bias(kind, bias):
    """A LayerNorm has a bias exactly when the linears do (an extra one would be a parameter no
    checkpoint of a bias-free model has); RMSNorm never has one. Epsilon 0.5 is far from any default."""
    cfg = config("gpt2", norm=kind, bias=bias, norm_eps=0.5)
    norm = build_norm(cfg)
    assert [name for name, _ in norm.named_parameters()] == (["weight", "bias"] if kind == "layernorm" and bias
                                                               else ["weight"])
    g = torch.Generator().manual_seed(0)
    x, branch = torch.randn(2, 3, cfg.hidden_size, generator=g), torch.randn(2, 3, cfg.hidden_size, generator=g)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(cfg.hidden_size, generator=g) + 0.5)
    if kind == "layernorm":
        expected = F.layer_norm(x + branch, (cfg.hidden_size,), norm.weight, norm.bias, eps=0.5)
    else:
        total = x + branch
        expected = total / (total.pow(2).mean(-1, keepdim=True) + 0.5).sqrt() * norm.weight
    with torch.no_grad():
        assert close(norm(x + branch), expected)
        total, normed = norm(x, branch)
        assert torch.equal(total, x + branch) and close(normed, expected)


def test_bf16_rms_norm_rounds_before_the_weight_and_the_loss_is_fp32():
    """In bf16 two conventions give other numbers from the same weights: RMSNorm rounds the normalised
    activations to bf16 and then multiplies by the weight, as Llama's checkpoints were trained
    (planted: the product rounded instead, every value of a converted Llama off by a rounding); the
    per-token loss is computed from the bf16 logits in fp32 (planted: in bf16, a loss of 10.4 read as
    10.375 and the gradient scaled by it)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    weight = (torch.rand(64, generator=g) + 0.5).to(torch.bfloat16)
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(ops.rms_norm(x, weight, 1e-5), weight * normed)
    logits = (3 * torch.randn(6, 100, generator=g)).to(torch.bfloat16)
    labels = torch.randint(0, 100, (6,), generator=g)
    loss = ops.cross_entropy(logits, labels)
    assert loss.dtype == torch.float32 and torch.equal(loss, F.cross_entropy(logits.float(), labels, reduction="none"))


def test_attention_dropout_is_off_in_eval():
    """Generation and evaluation run the model in eval mode: attention probabilities are then not dropped."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))
    core = AttentionCore(0.5)
    assert not torch.equal(core(q, k, v), ops.attention(q, k, v, 0.0))  # training: dropped
    assert torch.equal(core.eval()(q, k, v), ops.attention(q, k, v, 0.0))


@pytest.mark.parametrize("field,value,build", [("activation", "relu", MLP), ("norm", "batchnorm", build_norm)])
def test_unknown_architecture_switches_are_refused_naming_the_field(field, value, build):
    """A config built in code skips the loader's choice check; the layers refuse what they do not know
    rather than building their default."""
    with pytest.raises(ValueError, match=f"model.{field}: unknown"):
        build(config("gpt2", **{field: value}))


def test_swiglu_width_rounds_8h_over_3_up_to_a_multiple_of_64():
    """Rounded down, the MLP would be narrower than the 8h/3 that keeps SwiGLU's parameters at GeLU's 4h."""
    assert ModelConfig(activation="swiglu", hidden_size=64).ffn_size == 192  # 170.7 -> 192, not 128
    assert ModelConfig(activation="swiglu", hidden_size=96).ffn_size == 256  # already a multiple
    assert ModelConfig(activation="gelu", hidden_size=64).ffn_size == 256


def test_defaults_are_those_of_the_published_checkpoints():
    """A config that leaves these out gets the rotary base of Llama and Hugging Face's default
    (10000) and GPT-2's LayerNorm epsilon (1e-5)."""
    cfg = ModelConfig()
    assert (cfg.rope_theta, cfg.norm_eps) == (10000.0, 1e-5)


def test_vocabulary_padding_rounds_up_to_the_multiple_and_drops_only_padding():
    """A vocabulary already a multiple is not padded further (the checkpoint's rows are what Megatron
    pads to); shrinking a padded matrix keeps the real rows, the first ones."""
    assert [padded_vocab_size(v, 128) for v in (1, 128, 129, 256)] == [128, 128, 256, 256]
    t = torch.arange(12.0).view(6, 2)
    assert torch.equal(fit_rows(t, 4), t[:4])
    assert torch.equal(fit_rows(t, 8), torch.cat([t, torch.zeros(2, 2)])) and fit_rows(t, 6) is t


def test_learned_positions_add_row_t_of_the_table_to_token_t():
    """Position t reads row t: the equivalence tests build reference and split model from this same
    module, so a table read in another order passes there."""
    cfg = config("gpt2")
    embedding = GPT(cfg, seed=3).embedding
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length - 3), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = embedding.tokens.weight[ids] + embedding.positions.weight[:ids.shape[1]]
        assert torch.equal(embedding(ids), expected)


def test_gpt2_preset_builds_learned_positions_layernorm_gelu_and_a_tied_head():
    """What the preset's name promises, read off the built model (a preset's switches reach the layers
    only through the config, so a switch set wrong shows nowhere else)."""
    model = GPT(config("gpt2"), seed=3)
    block = model.layers["0"]
    assert model.embedding.positions is not None and block.attention.rope_theta is None
    assert isinstance(block.attn_norm, LayerNorm) and block.attn_norm.bias is not None
    assert not block.mlp.gated and block.mlp.fc_in.bias is not None
    assert model.lm_head.weight is model.embedding.tokens.weight
