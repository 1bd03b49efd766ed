"""The GPT decoder, written as if it ran on one device, and buildable one pipeline stage at a time.

``GPT(cfg)`` is the whole model. ``GPT(cfg, layers=range(a, b), has_embedding=..., has_head=...)``
is one pipeline stage: the blocks keep their global index as their name (``layers.7``), so a stage's
parameter names, initial values and checkpoint keys are those of the full model.

Stage interface (what a pipeline schedule relies on)::

    stage(inputs, labels=None, reduction="none")
    inputs  first stage (has_embedding): token ids, int64 [batch, seq]
            other stages: the previous stage's hidden state, [batch, seq, hidden]
            (under sequence parallelism [batch, seq / tp, hidden]: this rank's chunk of the tokens)
    returns last stage (has_head) with labels: the loss, fp32; with reduction "none" per token,
            [batch, seq] (0 where the label is ops.IGNORE_INDEX), with "sum" its sum over tokens, a
            scalar (training asks for the sum and divides by the count of real labels: the fused
            loss then computes its gradient in the forward pass)
            last stage without labels: logits [batch, seq, padded_vocab] (padded_vocab / tp under
            tensor parallelism: this rank's vocabulary slice); columns >= vocab_size are padding
            other stages: the hidden state, shaped as the inputs of the next stage

Parallelism is not in this file: ``TP_PLAN`` says, as data, how each layer splits across tensor-
parallel ranks, and ``parallel.tensor_parallel`` applies it (see ``models.parallelize``).
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
from torch import nn

from models import ops
from models.attention import Attention
from models.config import ModelConfig
from models.embedding import VOCAB_MULTIPLE, Embedding, padded_vocab_size
from models.init import seeded_normal
from models.kv_cache import KVCache, LayerCache
from models.mlp import MLP
from models.norms import NORMS, build_norm
from parallel.pipeline.partition import BLOCK_PARTS
from parallel.tensor_parallel.sharding import param_shards

TP_PLAN = {
    "embedding.tokens": "vocab",              # vocabulary rows split across tp
    "embedding": "split_sequence",            # output scattered along the sequence (sequence parallel)
    "layers.*.attn_norm": "sequence",         # runs on a token chunk under sequence parallel
    "layers.*.attention.qkv": "colwise",      # whole attention groups per rank
    "layers.*.attention.core": "local",       # heads differ per rank: tp-local dropout
    "layers.*.attention.out": "rowwise",
    "layers.*.mlp_norm": "sequence",
    "layers.*.mlp.fc_in": "colwise",
    "layers.*.mlp.fc_out": "rowwise",
    "layers.*.dropout": "sequence",
    "final_norm": "sequence",
    "lm_head": "colwise",                     # logits stay split by vocabulary...
    "loss": "vocab_loss",                     # ...and the loss never gathers them
}
"""Tensor-parallel style of each module, by name pattern (``*`` matches one name component)."""

RECOMPUTE_TARGETS = {"full": "layers.*", "selective": "layers.*.attention.core"}
"""Modules re-run in backward for each activation-checkpointing mode."""

OUTPUT_PROJECTIONS = ("attention.out.weight", "mlp.fc_out.weight")

EMBEDDING_WEIGHT = "embedding.tokens.weight"
VOCAB_PADDED = (EMBEDDING_WEIGHT, "lm_head.weight")
"""Parameters whose first dimension is the padded vocabulary: their padding rows may be added or
dropped when a checkpoint moves to another tensor-parallel size (the padding is 128·tp)."""


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)), dropout on each branch.

    The first residual add is done by the MLP's norm with its normalisation (one fused op on GPU).
    A pipeline stage may hold one of the two ``parts`` only (a split such as ``[12.5, 11.5]``): the
    attention part returns the residual sum after the attention, which the MLP part on the next stage
    normalises, so the two halves compute what the whole block does.
    """

    def __init__(self, cfg: ModelConfig, device=None, parts: tuple[str, ...] = BLOCK_PARTS):
        super().__init__()
        if not parts or any(part not in BLOCK_PARTS for part in parts):
            raise ValueError(f"block parts {parts}: use a non-empty subset of {BLOCK_PARTS}")
        self.attn_norm = build_norm(cfg, device) if "attention" in parts else None
        self.attention = Attention(cfg, device) if "attention" in parts else None
        self.mlp_norm = build_norm(cfg, device) if "mlp" in parts else None
        self.mlp = MLP(cfg, device) if "mlp" in parts else None
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cache: Optional[LayerCache] = None) -> torch.Tensor:
        if self.attention is None:
            return x + self.dropout(self.mlp(self.mlp_norm(x)))
        normed = self.attn_norm(x)
        # the cache only where there is one: what wraps the attention (tensor parallelism, ZeRO-3's
        # gathers, compiled and graphed blocks) sees the call it always did
        branch = self.dropout(self.attention(normed) if cache is None else self.attention(normed, cache))
        if self.mlp is None:
            return x + branch
        x, normed = self.mlp_norm(x, branch)
        return x + self.dropout(self.mlp(normed))


class LMLoss(nn.Module):
    """Cross-entropy over the real (unpadded) vocabulary, per token or summed (``reduction``, see
    ``ops.linear_cross_entropy``), from the final hidden state and the head that projects it: one op,
    so that on GPU the logits exist a chunk of tokens at a time."""

    kernel_for = staticmethod(ops.fused_linear_cross_entropy)
    """The fused body for a hidden state's device (or None), for a replacement of this module."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, reduction: str) -> torch.Tensor:
        return ops.linear_cross_entropy(hidden, head.weight, labels, self.vocab_size, reduction)


class GPT(nn.Module):
    """A decoder-only transformer, or the stage of one holding ``layers`` (global block indices).

    ``parts``: the blocks of ``layers`` this stage holds in part, with the part (``Block``; see
    ``parallel.pipeline.partition.stage_parts``); the others are whole.
    ``vocab_multiple``: the vocabulary is padded to a multiple of this; pass ``128 * tp`` when the
    model will be tensor-parallel. ``device="meta"`` builds without memory or initialisation (call
    ``to_empty`` then ``init_weights(seed)`` once parallelism is applied); any other device builds
    and initialises at once. Initial values depend only on ``seed`` and the parameter names.
    """

    def __init__(self, cfg: ModelConfig, layers: Optional[Iterable[int]] = None, has_embedding: bool = True,
                 has_head: bool = True, vocab_multiple: int = VOCAB_MULTIPLE, seed: int = 0, device=None,
                 parts: Optional[dict[int, tuple[str, ...]]] = None):
        super().__init__()
        layers = list(range(cfg.num_layers) if layers is None else layers)
        if any(not 0 <= i < cfg.num_layers for i in layers):
            raise ValueError(f"layers {layers} fall outside model.num_layers = {cfg.num_layers}")
        parts = parts or {}
        if not set(parts) <= set(layers):
            raise ValueError(f"block parts {parts} name blocks outside layers {layers}")
        self.cfg = cfg
        self.vocab_size = cfg.vocab_size
        self.padded_vocab = padded_vocab_size(cfg.vocab_size, vocab_multiple)
        self.embedding = Embedding(cfg, self.padded_vocab, "meta") if has_embedding else None
        self.layers = nn.ModuleDict({str(i): Block(cfg, "meta", parts.get(i, BLOCK_PARTS)) for i in layers})
        self.final_norm = build_norm(cfg, "meta") if has_head else None
        self.lm_head = nn.Linear(cfg.hidden_size, self.padded_vocab, bias=False, device="meta") if has_head else None
        self.loss = LMLoss(cfg.vocab_size) if has_head else None
        self.tie_weights()
        if torch.device(device or "cpu").type != "meta":
            self.to_empty(device=device or "cpu")
            self.init_weights(seed)

    @property
    def tied(self) -> bool:
        return self.cfg.tie_embeddings

    @property
    def tied_head_copy(self) -> Optional[nn.Parameter]:
        """The head's weight when it is this stage's copy of an embedding held by the first stage
        (the pipeline keeps the two equal), else None."""
        if self.tied and self.embedding is None and self.lm_head is not None:
            return self.lm_head.weight
        return None

    def logical_name(self, name: str) -> str:
        """The single-device model's name of parameter ``name``: a tied head copy is the embedding."""
        return EMBEDDING_WEIGHT if self.tied_head_copy is not None and name == "lm_head.weight" else name

    def tie_weights(self) -> None:
        """Share the embedding with the head when both live here (again after ``to_empty``).

        A tied head on a stage without the embedding keeps its own copy, initialised identically;
        the pipeline keeps the two equal by summing their gradients over the embedding group.
        """
        if self.tied and self.embedding is not None and self.lm_head is not None:
            self.lm_head.weight = self.embedding.tokens.weight

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                reduction: str = "none") -> torch.Tensor:
        x = self.embedding(inputs) if self.embedding is not None else inputs
        for block in self.layers.values():
            x = block(x)
        if self.lm_head is None:
            return x
        return self.head(x, labels, reduction)

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The logits [batch, padded_vocab] after the last of ``ids`` [batch, seq], which follow the
        tokens ``cache`` holds; the cache takes theirs. The whole model on one device only: decoding
        reads a prompt once, then each drawn token alone, and needs the logits of the last position
        alone (the rest would cost a vocabulary-wide product per prompt token)."""
        cache.check_room(ids.shape[1])  # before the positions are looked up: a learned table ends there
        x = self.embedding(ids, cache.start)
        for name, block in self.layers.items():
            x = block(x, cache.layer(name))
        cache.advance(ids.shape[1])
        return self.lm_head(self.final_norm(x[:, -1]))

    def head(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None, reduction: str = "none") -> torch.Tensor:
        """Final norm, then the logits, or (given labels) the loss, reduced as ``reduction`` says: the
        loss module takes the head itself, so a fused kernel can project and reduce the vocabulary in
        chunks (the logits are the largest activation of the model)."""
        x = self.final_norm(x)
        return self.lm_head(x) if labels is None else self.loss(x, self.lm_head, labels, reduction)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Matrices normal(0, std), output projections scaled by 1/sqrt(2*layers); norms 1, biases 0;
        the rotary tables filled, one shared by every layer (a table per layer would hold seq x
        head_dim fp32 values each: 64 MiB a layer at a 128k sequence).

        Tensor-parallel shards draw exactly their slice of the full weight (see ``models.init``).
        """
        self.tie_weights()
        tables = None  # one rotary table for every layer (each holds it as a buffer)
        for block in self.layers.values():
            if block.attention is None or block.attention.rope_theta is None:
                continue
            if tables is None:
                block.attention.reset_rotary()
                tables = block.attention.rotary_cos, block.attention.rotary_sin
            else:
                block.attention.rotary_cos, block.attention.rotary_sin = tables
        shards = param_shards(self)
        for name, param in self.named_parameters():
            module_name, _, leaf = name.rpartition(".")
            if isinstance(self.get_submodule(module_name), NORMS):
                param.fill_(1.0 if leaf == "weight" else 0.0)
            elif param.ndim == 1:
                param.zero_()
            else:
                param.copy_(self._draw(name, param, shards.get(name), seed))

    def _draw(self, name: str, param: torch.Tensor, shard, seed: int) -> torch.Tensor:
        std, key, zero_from = self.cfg.effective_init_std, name, None
        if name.endswith(OUTPUT_PROJECTIONS):
            std /= math.sqrt(2 * self.cfg.num_layers)
        if name in VOCAB_PADDED:
            zero_from = self.vocab_size
            key = EMBEDDING_WEIGHT if self.tied else name
        full_shape = shard.full_shape(param.shape) if shard is not None else tuple(param.shape)
        return seeded_normal(full_shape, std, seed, key, shard, zero_from)
