"""Megatron-LM's legacy ``torch`` checkpoints as a conversion target: what ``MegatronSource`` reads.

Layout: ``ROOT/latest_checkpointed_iteration.txt`` naming ``release``, and ``ROOT/release/
mp_rank_TT[_PPP]/model_optim_rng.pt`` for each tensor rank ``TT`` and pipeline rank ``PPP``, each
holding ``args`` (an ``argparse.Namespace``), ``checkpoint_version`` 3.0, ``iteration`` 0 and
``model``: that rank's state dict of megatron-core's ``GPTModel``, named for the layer implementation
the Megatron-LM run will use (``--transformer-impl``). The two name a layer's norms differently: the
local spec (``get_gpt_layer_local_spec``) keeps them as modules of their own, Transformer Engine's
fuses each into the linear after it (``linear_qkv.layer_norm_weight``). Megatron-LM loads a file of
the other naming without a word, retrying without strictness when its strict load fails, and leaves
those norms at their initial values; so the implementation is never guessed.

Why ``release``: Megatron-LM loads only the model from a release checkpoint and starts at iteration
0 with an optimizer and random state of its own, which is what a converted model needs (no optimizer
state is written; a numbered iteration would have it look for one).

Megatron's own conventions: layers split evenly over the stages; the vocabulary padded to a multiple
of ``make_vocab_size_divisible_by`` (128) x tp, here with zero rows; a tied head, on a pipeline of
several stages, kept as a copy of the embedding in the last stage's ``output_layer.weight``. The
args record the model as Megatron-LM's flags would, and the fields its ``check_checkpoint_args``
compares by default, so none is missing when it loads.
A stage's files are built together (host memory: one stage of the model), each tensor slice copied
out of the whole so a file holds only its rank's share.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from megazero.convert.hf import DTYPES
from megazero.convert.megatron import FILE, FUSED_NORM, core_key, rank_dir, tanh_gelu
from megazero.convert.sources import Source, logical_shapes
from megazero.convert.streaming import cast_checked
from megazero.errors import UserError
from models.config import ModelConfig
from models.embedding import fit_rows
from models.gpt import VOCAB_PADDED

VOCAB_DIVISOR = 128  # Megatron-LM's default --make-vocab-size-divisible-by
TIED = "embedding.tokens.weight"  # also the head, where the model ties them


def layout_problem(cfg: ModelConfig, tp: int, pp: int) -> str | None:
    """Why megatron-core cannot hold ``cfg`` at ``tp`` x ``pp``, naming the flag; None where it can."""
    for what, count in (("attention heads", cfg.num_heads), ("key/value heads", cfg.kv_heads),
                        ("MLP columns", cfg.ffn_size)):
        if count % tp:
            return f"--tp {tp}: the model's {count} {what} do not split evenly over {tp} tensor ranks; give a --tp that divides {count}"
    if cfg.num_layers % pp:
        return (f"--pp {pp}: the model's {cfg.num_layers} layers do not split evenly over {pp} stages (Megatron-LM's "
                f"split); give a --pp that divides {cfg.num_layers}")
    return None


def megatron_args(cfg: ModelConfig, tp: int, pp: int, dtype: torch.dtype, impl: str) -> argparse.Namespace:
    """The ``args`` Megatron-LM would have recorded for this model and layout. Where its flags do not
    change the model, their defaults: ``add_position_embedding`` is True unless
    ``--no-position-embedding``, which rotary runs do not pass either (megatron-core goes by
    ``position_embedding_type``). The GeLU: megatron-core's tanh one needs ``bias_gelu_fusion`` and
    biases (``tanh_gelu``); without the switch it computes the exact one. Its tokenizer is not known
    here, and Megatron-LM compares ``tokenizer_type`` only for tokenizers given by ``--vocab-file``,
    the BPE ones: GPT-2's where the vocabulary is GPT-2's 50,257, else unset."""
    learned = cfg.position_embedding == "learned"
    multiple = VOCAB_DIVISOR * tp
    return argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_size,
        num_attention_heads=cfg.num_heads, kv_channels=cfg.head_dim, group_query_attention=cfg.kv_heads != cfg.num_heads,
        num_query_groups=cfg.kv_heads, max_position_embeddings=cfg.seq_length, seq_length=cfg.seq_length,
        position_embedding_type="learned_absolute" if learned else "rope", add_position_embedding=True,
        rotary_base=cfg.rope_theta, rotary_percent=1.0, rotary_interleaved=False,
        normalization="LayerNorm" if cfg.norm == "layernorm" else "RMSNorm", norm_epsilon=cfg.norm_eps,
        swiglu=cfg.activation == "swiglu", bias_gelu_fusion=cfg.bias and cfg.activation == "gelu",
        openai_gelu=False, add_bias_linear=cfg.bias, transformer_impl=impl,
        add_qkv_bias=cfg.bias, untie_embeddings_and_output_weights=not cfg.tie_embeddings,
        hidden_dropout=cfg.dropout, attention_dropout=cfg.attention_dropout, vocab_size=cfg.vocab_size,
        padded_vocab_size=-(-cfg.vocab_size // multiple) * multiple, make_vocab_size_divisible_by=VOCAB_DIVISOR,
        tokenizer_type="GPT2BPETokenizer" if cfg.vocab_size == 50257 else None, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        data_parallel_random_init=False, consumed_train_samples=0, consumed_valid_samples=0, iteration=0)


def tp_slices(t: torch.Tensor, split: str, tp: int) -> list[torch.Tensor]:
    """Each tensor rank's share of ``t`` (``core_key``'s ``split``), copied out of it."""
    if split == "whole":
        return [t.clone() for _ in range(tp)]
    if split == "swiglu":  # ours interleaves gate and up rows; each Megatron rank holds its gates, then its ups
        gate, up = t.unflatten(0, (-1, 2)).unbind(1)
        return [torch.cat(pair) for pair in zip(gate.chunk(tp), up.chunk(tp))]
    return [piece.clone() for piece in t.chunk(tp, dim=1 if split == "columns" else 0)]


def write_megatron(source: Source, root: Path, tp: int, pp: int, impl: str, dtype: str = "fp32") -> None:
    """Write ``source`` under ``root`` as Megatron-LM's legacy checkpoint for ``tp`` x ``pp``, named for
    the layer implementation ``impl``."""
    cfg = source.cfg
    problem = layout_problem(cfg, tp, pp)
    if problem:
        raise UserError(problem)
    args = megatron_args(cfg, tp, pp, DTYPES[dtype], impl)
    if cfg.activation == "gelu" and not tanh_gelu(cfg.bias, args.bias_gelu_fusion):
        raise UserError("model.activation: 'gelu' (the tanh approximation) without linear biases (model.bias false) "
                        "cannot be expressed by megatron-core, which computes the GeLU of such a model exactly (erf, "
                        "megazero's gelu_exact); export it to Hugging Face instead")
    swiglu = cfg.activation == "swiglu"
    per_stage = cfg.num_layers // pp
    release = root / "release"
    for p in range(pp):
        models: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
        for name in logical_shapes(cfg):
            layer, key, split = core_key(name, swiglu)
            if layer is not None:
                norm, leaf = key.rsplit(".", 1)
                if impl == "transformer_engine" and norm in FUSED_NORM:
                    key = f"{FUSED_NORM[norm]}.layer_norm_{leaf}"
                stage, key = layer // per_stage, f"decoder.layers.{layer % per_stage}.{key}"
            elif name == TIED and cfg.tie_embeddings and pp > 1 and p == pp - 1:
                stage, key = p, "output_layer.weight"  # the last stage's copy of a tied embedding
            else:
                stage = 0 if key.startswith("embedding.") else pp - 1
            if stage != p:
                continue
            tensor = source.read(name).float()
            if name in VOCAB_PADDED:
                tensor = fit_rows(tensor, args.padded_vocab_size)
            for rank, piece in enumerate(tp_slices(tensor, split, tp)):
                models[rank][key] = cast_checked(piece, DTYPES[dtype], name)
                if cfg.norm == "layernorm" and not cfg.bias and name.endswith("norm.weight"):
                    # megatron-core's LayerNorm always has a bias (--disable-bias-linear keeps it); ours has
                    # none without linear biases: zero is exactly none, and a strict load finds every key
                    models[rank][key[: -len("weight")] + "bias"] = torch.zeros_like(models[rank][key])
        for t, model in enumerate(models):
            folder = release / rank_dir(t, p, pp)
            folder.mkdir(parents=True)
            with open(folder / FILE, "wb") as f:  # a file object: a full disk is an OSError, not torch's RuntimeError
                torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 0, "model": model}, f)
    (root / "latest_checkpointed_iteration.txt").write_text("release")
