"""The two Hugging Face model classes megazero maps to, as data and small tensor functions.

Each family says which of our configs its class can express (and names the field that it cannot),
translates ``config.json`` both ways, and maps one of our logical parameters to its Hugging Face
tensors (``to_hf``) or back (``from_hf``). Every map reads or emits the tensors of one logical
parameter only, so a conversion streams parameter by parameter.

Row layouts that differ:

* fused ``qkv``: ours groups rows by key/value head (``r`` query heads, then k, then v, each
  ``head_dim`` rows; ``models.attention``); Llama has separate q/k/v projections with heads in
  order, GPT-2 one ``c_attn`` with all q rows, then all k, then all v.
* SwiGLU ``fc_in``: ours interleaves gate and up rows (``models.mlp``); Llama has ``gate_proj`` and
  ``up_proj``.
* GPT-2's ``Conv1D`` stores weights as [in, out]: transposed.
* Rotary: ours is the rotate-half convention with the same frequencies as Llama's (``models.ops``),
  so q and k rows need no permutation within a head.
* Vocabulary: ours is padded (to 128·tp); the caller strips or adds the padding rows.
"""

from __future__ import annotations

import itertools
import re
from typing import Callable, Optional

import torch

from data_pipeline.typed_config import coerce, field_types
from megazero.errors import ConfigError, UserError
from models.config import ModelConfig

Read = Callable[[str], torch.Tensor]
LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
MODEL_FIELD = re.compile(r"\bmodel\.(\w+)")
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
"""Hugging Face's names of megazero's ``gelu``, the tanh approximation: ``transformers`` computes the
two with different code, a few ulp apart, so an export writes the name the model was imported with."""
GELUS = {**dict.fromkeys(TANH_GELUS, "gelu"), "gelu": "gelu_exact"}
"""Hugging Face's names of the GeLUs megazero computes, to ``model.activation``: its ``gelu`` is the
exact one (erf), the other two the tanh approximation."""


def refuse(field: str, value, why: str, fix: str) -> UserError:
    return UserError(f"{field}: {value!r} {why}; {fix}")


def typed(hf: dict, family, where: str) -> dict:
    """Our model fields as ``config.json`` gives them (``family.KEYS``: our field -> its key; an absent
    key takes ``family.DEFAULTS``, and one without a default is required), each checked against
    ``ModelConfig``'s type the way `megazero train` checks a config: a ``"4096"`` is refused here,
    naming its key, rather than failing later in arithmetic on it."""
    hints = field_types(ModelConfig)
    values = {}
    for field, key in file_keys(hf, family).items():
        named = family.KEYS[field]
        if key != named and named in hf and hf[named] != hf[key]:
            raise refuse(f"{where}: {key}", hf[key], f"differs from {named} = {hf[named]!r}, and transformers "
                         f"reads {key}, another tool {named}", "keep one of the two")
        if key in hf:
            values[field] = coerce(hf[key], hints[field], f"{where}: {key}", UserError)
        elif field in family.DEFAULTS:
            values[field] = family.DEFAULTS[field]
        else:
            raise UserError(f"{where}: has no {key!r} field, which {family.hf_class} needs; the file is incomplete")
    return values


def file_keys(hf: dict, family) -> dict[str, str]:
    """Our field -> the ``config.json`` key that gives it in this file: ``family.KEYS``', or the alias
    where the file has one (``family.ALIASES``; transformers sets the alias after the key: it wins)."""
    return {field: family.ALIASES[key] if family.ALIASES.get(key) in hf else key for field, key in family.KEYS.items()}


def validated(cfg: ModelConfig, keys: dict[str, str], where: str) -> ModelConfig:
    """``cfg`` if `megazero train` would take it as its model section (positive sizes, heads dividing
    the width, ...), else a ``UserError`` with one line per problem, each field it names given as
    the file's key behind it (``keys``: our field -> that key). Without this a model with -1 layers converts into one with
    none, and heads that do not divide the width fail deep inside the conversion."""
    from megazero.config.schema import Config
    from megazero.config.validate import validate_config

    def key(match: re.Match) -> str:
        field = match.group(1)
        return f"{keys[field]} ({match.group(0)})" if field in keys else match.group(0)

    try:
        validate_config(Config(model=cfg))
    except ConfigError as e:
        raise UserError("\n".join(f"{where}: {MODEL_FIELD.sub(key, problem)}" for problem in str(e).splitlines())) \
            from None
    return cfg


def check_model_type(hf: dict, family, where: str) -> None:
    """``transformers`` builds the model named by ``model_type``, not by ``architectures``: a folder
    whose ``model_type`` is another family's (a Mistral under a Llama class name) holds that other
    model, and one whose sliding attention window is switched on and shorter than its context was
    trained with a window megazero's attention does not have (``use_sliding_window: false``, or a
    window as long as the context, is full attention). Importing either as ``family`` would silently change the model."""
    model_type = hf.get("model_type", family.model_type)
    if model_type != family.model_type:
        raise refuse(f"{where}: model_type", model_type, f"is not {family.hf_class}'s {family.model_type!r} "
                     "(transformers builds the model model_type names, whatever architectures says)",
                     "convert such a model with its own tools")
    window, context = (coerce(hf.get(key), Optional[int], f"{where}: {key}", UserError)
                       for key in ("sliding_window", "max_position_embeddings"))
    if window is not None and hf.get("use_sliding_window") is not False and not (context and window >= context):
        raise refuse(f"{where}: sliding_window", window, "asks for sliding-window attention, which megazero's "
                     "attention does not have", "only full-attention models can be imported")


class GPT2:
    hf_class, model_type, preset = "GPT2LMHeadModel", "gpt2", "gpt2"
    OTHER = "convert with --to megazero or --to torch instead, or train a model with the gpt2 preset"
    KEYS = {"num_layers": "n_layer", "hidden_size": "n_embd", "num_heads": "n_head", "ffn_hidden_size": "n_inner",
            "vocab_size": "vocab_size", "seq_length": "n_positions", "norm_eps": "layer_norm_epsilon",
            "tie_embeddings": "tie_word_embeddings", "dropout": "resid_pdrop", "attention_dropout": "attn_pdrop",
            "init_std": "initializer_range"}
    DEFAULTS = {"ffn_hidden_size": None, "seq_length": 1024, "norm_eps": 1e-5, "tie_embeddings": True,
                "dropout": 0.1, "attention_dropout": 0.1, "init_std": 0.02}
    """GPT2Config's own defaults (its dropout rates are 0.1, its initializer_range 0.02): a key left out
    means what ``from_pretrained`` makes of it."""
    ALIASES = {"n_embd": "hidden_size", "n_positions": "max_position_embeddings", "n_head": "num_attention_heads",
               "n_layer": "num_hidden_layers"}
    """GPT2Config's ``attribute_map``: a ``config.json`` may give a size under either name."""
    KEPT = ("activation_function",)
    """``config.json`` keys an import records (``sources.HF_CONFIG_RECORD``) for an export back: which
    of the tanh GeLU's two names the model had."""
    BUFFERS = (re.compile(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)"),)
    """Tensors that hold no weights (the causal-mask buffers older versions of ``transformers``
    saved, which it skips on load itself): a folder may have them; they are not imported."""
    BASE = "transformer"
    """``transformers``' ``base_model_prefix``: a folder saved from the bare ``GPT2Model`` (as the hub's
    ``openai-community/gpt2`` is) names its tensors without it (``wte.weight``, ``h.0.attn.c_attn.weight``)."""

    @classmethod
    def check(cls, cfg: ModelConfig) -> None:
        """Refuse what GPT2LMHeadModel cannot hold. Missing biases are not refused: they are written
        as zeros, which computes the same."""
        if cfg.norm != "layernorm":
            raise refuse("model.norm", cfg.norm, "cannot be expressed by GPT2LMHeadModel (LayerNorm only)", cls.OTHER)
        if cfg.activation not in ("gelu", "gelu_exact"):
            raise refuse("model.activation", cfg.activation, "cannot be expressed by GPT2LMHeadModel (its MLP is not "
                         "gated)", cls.OTHER)
        if cfg.kv_heads != cfg.num_heads:
            raise refuse("model.num_kv_heads", cfg.num_kv_heads, "cannot be expressed by GPT2LMHeadModel (no "
                         "grouped-query attention)", cls.OTHER)

    @staticmethod
    def hf_config(cfg: ModelConfig, kept: Optional[dict] = None) -> dict:
        return {"n_positions": cfg.seq_length, "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
                "n_head": cfg.num_heads, "n_inner": cfg.ffn_size, "activation_function": GPT2.activation(cfg, kept),
                "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.attention_dropout,
                "layer_norm_epsilon": cfg.norm_eps, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}

    @staticmethod
    def activation(cfg: ModelConfig, kept: Optional[dict]) -> str:
        """The ``activation_function`` written for ``cfg``: ``gelu`` for the exact GeLU; for the tanh one
        the name ``kept`` from the import where it is one of the tanh GeLU's (a record naming another
        activation is not the model's and is not written), else ``gelu_new``."""
        if cfg.activation == "gelu_exact":
            return "gelu"
        name = (kept or {}).get("activation_function")
        return name if name in TANH_GELUS else "gelu_new"

    @classmethod
    def model_config(cls, hf: dict, where: str) -> ModelConfig:
        act = hf.get("activation_function", "gelu_new")
        if not isinstance(act, str) or act not in GELUS:
            raise refuse(f"{where}: activation_function", act, "is not a GeLU megazero computes",
                         "only gelu_new / gelu_pytorch_tanh (the tanh approximation) and gelu (exact) models can be "
                         "imported")
        embedding, residual = hf.get("embd_pdrop", 0.1), hf.get("resid_pdrop", 0.1)
        if embedding != residual:
            raise refuse(f"{where}: embd_pdrop", embedding, f"differs from resid_pdrop = {residual!r}, and megazero "
                         "has one dropout rate for the embeddings and the residual branches", "give both one rate")
        for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("add_cross_attention", False)):
            if hf.get(key, ok) != ok:
                raise refuse(f"{where}: {key}", hf[key], "has no counterpart in megazero's GPT",
                             f"only models with {key}={ok} can be imported")
        cfg = ModelConfig(preset="gpt2", position_embedding="learned", norm="layernorm", activation=GELUS[act],
                          bias=True, **typed(hf, cls, where))
        return validated(cfg, file_keys(hf, cls), where)

    LAYER_NAMES = {"attn_norm": "ln_1", "mlp_norm": "ln_2", "attention.qkv": "attn.c_attn",
                   "attention.out": "attn.c_proj", "mlp.fc_in": "mlp.c_fc", "mlp.fc_out": "mlp.c_proj"}
    NAMES = {"embedding.tokens": "transformer.wte", "embedding.positions": "transformer.wpe",
             "final_norm": "transformer.ln_f", "lm_head": "lm_head"}

    @classmethod
    def hf_name(cls, name: str) -> str:
        module, leaf = name.rsplit(".", 1)
        layer = LAYER.match(module)
        if layer:
            return f"transformer.h.{layer.group(1)}.{cls.LAYER_NAMES[layer.group(2)]}.{leaf}"
        return f"{cls.NAMES[module]}.{leaf}"

    @classmethod
    def to_hf(cls, name: str, t: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
        hf = cls.hf_name(name)
        if name.endswith("attention.qkv.weight") or name.endswith("attention.qkv.bias"):
            t = t.unflatten(0, (cfg.num_heads, 3, cfg.head_dim)).transpose(0, 1).flatten(0, 2)
        if t.ndim == 2 and LAYER.match(name):
            t = t.t()  # Conv1D: [in, out]
        out = [(hf, t)]
        if not cfg.bias and name.endswith(".weight") and not name.startswith(("embedding.", "lm_head")):
            width = t.shape[-1]  # LayerNorm and Conv1D always carry a bias: zero is exactly none
            out.append((hf[: -len("weight")] + "bias", torch.zeros(width, dtype=t.dtype, device=t.device)))
        return out

    @classmethod
    def from_hf(cls, name: str, read: Read, cfg: ModelConfig) -> torch.Tensor:
        t = read(cls.hf_name(name))
        if t.ndim == 2 and LAYER.match(name):
            t = t.t()
        if name.endswith("attention.qkv.weight") or name.endswith("attention.qkv.bias"):
            t = t.unflatten(0, (3, cfg.num_heads, cfg.head_dim)).transpose(0, 1).flatten(0, 2)
        return t.contiguous()


class Llama:
    hf_class, model_type, preset = "LlamaForCausalLM", "llama", "llama"
    OTHER = "convert with --to megazero or --to torch instead, or train a model with the llama preset"
    KEYS = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "num_heads": "num_attention_heads",
            "num_kv_heads": "num_key_value_heads", "ffn_hidden_size": "intermediate_size", "vocab_size": "vocab_size",
            "seq_length": "max_position_embeddings", "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps",
            "tie_embeddings": "tie_word_embeddings", "bias": "attention_bias", "attention_dropout": "attention_dropout",
            "init_std": "initializer_range"}
    DEFAULTS = {"num_kv_heads": None, "seq_length": 2048, "rope_theta": 10000.0, "norm_eps": 1e-6,
                "tie_embeddings": False, "bias": False, "attention_dropout": 0.0, "init_std": 0.02}
    ALIASES: dict[str, str] = {}
    KEPT: tuple[str, ...] = ()
    """Nothing: ``hidden_act`` has the one name, ``silu``."""
    BUFFERS = (re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),)
    """The rotary frequencies older versions of ``transformers`` saved: computed from rope_theta."""
    BASE = "model"
    """``transformers``' ``base_model_prefix`` (a bare ``LlamaModel`` saves ``embed_tokens.weight``)."""

    @classmethod
    def check(cls, cfg: ModelConfig) -> None:
        if cfg.norm != "rmsnorm":
            raise refuse("model.norm", cfg.norm, "cannot be expressed by LlamaForCausalLM (RMSNorm only)", cls.OTHER)
        if cfg.activation != "swiglu":
            raise refuse("model.activation", cfg.activation, "cannot be expressed by LlamaForCausalLM (its MLP is "
                         "SwiGLU)", cls.OTHER)

    @staticmethod
    def hf_config(cfg: ModelConfig, kept: Optional[dict] = None) -> dict:
        return {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size,
                "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
                "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
                "max_position_embeddings": cfg.seq_length, "rms_norm_eps": cfg.norm_eps,
                "rope_theta": cfg.rope_theta, "attention_bias": cfg.bias, "mlp_bias": cfg.bias,
                "attention_dropout": cfg.attention_dropout, "pretraining_tp": 1}

    @classmethod
    def model_config(cls, hf: dict, where: str) -> ModelConfig:
        if hf.get("hidden_act", "silu") != "silu":
            raise refuse(f"{where}: hidden_act", hf["hidden_act"], "is not SwiGLU's SiLU",
                         "only silu Llama models can be imported")
        ropes = {key: coerce(hf.get(key), dict, f"{where}: {key}", UserError) for key in ("rope_parameters", "rope_scaling")}
        for key, rope in ropes.items():  # both may be there, and transformers reads either
            if rope.get("rope_type", rope.get("type", "default")) != "default":
                raise refuse(f"{where}: {key}", rope.get("rope_type", rope.get("type")), "has no counterpart in "
                             "megazero's rotary embedding", "only models with plain rotary positions can be imported")
        # newer files keep the rotary base in the rope settings; every place that gives one must agree
        bases = {"rope_theta": hf["rope_theta"]} if hf.get("rope_theta") is not None else {}
        bases.update({f"{key}.rope_theta": rope["rope_theta"] for key, rope in ropes.items() if "rope_theta" in rope})
        bases = {key: coerce(base, float, f"{where}: {key}", UserError) for key, base in bases.items()}
        for (key, base), (other, other_base) in itertools.combinations(bases.items(), 2):
            if base != other_base:
                raise refuse(f"{where}: {key}", base, f"differs from the rotary base in {other} ({other_base!r}), "
                             "and versions of transformers differ in which they read", "keep one of the two")
        theta = {"rope_theta": next(iter(bases.values()))} if bases else {}
        values = typed({**hf, **theta}, cls, where)
        mlp_bias = coerce(hf.get("mlp_bias", False), bool, f"{where}: mlp_bias", UserError)
        if mlp_bias != values["bias"]:
            raise refuse(f"{where}: mlp_bias", mlp_bias, "differs from attention_bias; megazero's model.bias covers "
                         "both", "only models with both or neither can be imported")
        if values["num_kv_heads"] == values["num_heads"]:
            values["num_kv_heads"] = None
        cfg = validated(ModelConfig(preset="llama", position_embedding="rope", norm="rmsnorm", activation="swiglu",
                                    **values), file_keys(hf, cls), where)
        head_dim = coerce(hf.get("head_dim"), Optional[int], f"{where}: head_dim", UserError)
        if head_dim not in (None, cfg.head_dim):
            raise refuse(f"{where}: head_dim", head_dim, f"differs from hidden_size / num_attention_heads = "
                         f"{cfg.head_dim}", "megazero derives the head width from those two")
        return cfg

    LAYER_NAMES = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
                   "attention.out": "self_attn.o_proj", "mlp.fc_out": "mlp.down_proj"}
    NAMES = {"embedding.tokens": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head"}

    @classmethod
    def _split(cls, layer: str, module: str, leaf: str) -> Optional[list[str]]:
        """The Hugging Face tensors one fused tensor of ours becomes, or None if it is not fused."""
        prefix = f"model.layers.{layer}"
        if module == "attention.qkv":
            return [f"{prefix}.self_attn.{p}_proj.{leaf}" for p in "qkv"]
        if module == "mlp.fc_in":
            return [f"{prefix}.mlp.{p}_proj.{leaf}" for p in ("gate", "up")]
        return None

    @classmethod
    def _names(cls, name: str) -> tuple[list[str], Optional[str]]:
        module, leaf = name.rsplit(".", 1)
        layer = LAYER.match(module)
        if not layer:
            return [f"{cls.NAMES[module]}.{leaf}"], None
        fused = cls._split(layer.group(1), layer.group(2), leaf)
        if fused:
            return fused, layer.group(2)
        return [f"model.layers.{layer.group(1)}.{cls.LAYER_NAMES[layer.group(2)]}.{leaf}"], None

    @classmethod
    def to_hf(cls, name: str, t: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
        hf, fused = cls._names(name)
        if fused == "attention.qkv":
            r = cfg.num_heads // cfg.kv_heads
            groups = t.unflatten(0, (cfg.kv_heads, r + 2, cfg.head_dim))
            parts = [groups[:, :r].flatten(0, 2), groups[:, r].flatten(0, 1), groups[:, r + 1].flatten(0, 1)]
            return list(zip(hf, parts))
        if fused == "mlp.fc_in":
            pairs = t.unflatten(0, (cfg.ffn_size, 2))
            return list(zip(hf, [pairs[:, 0], pairs[:, 1]]))
        return [(hf[0], t)]

    @classmethod
    def from_hf(cls, name: str, read: Read, cfg: ModelConfig) -> torch.Tensor:
        hf, fused = cls._names(name)
        if fused == "attention.qkv":
            r = cfg.num_heads // cfg.kv_heads
            q, k, v = (read(n) for n in hf)
            return torch.cat([q.unflatten(0, (cfg.kv_heads, r, cfg.head_dim)),
                              k.unflatten(0, (cfg.kv_heads, 1, cfg.head_dim)),
                              v.unflatten(0, (cfg.kv_heads, 1, cfg.head_dim))], dim=1).flatten(0, 2)
        if fused == "mlp.fc_in":
            gate, up = (read(n) for n in hf)
            return torch.stack([gate, up], dim=1).flatten(0, 1)
        return read(hf[0])


FAMILIES = {GPT2.hf_class: GPT2, Llama.hf_class: Llama}


def family_for(cfg: ModelConfig):
    """The Hugging Face class for ``cfg``, chosen by its position encoding (learned: GPT-2, rotary:
    Llama), after checking the rest of the architecture fits that class."""
    family = GPT2 if cfg.position_embedding == "learned" else Llama
    family.check(cfg)
    return family
