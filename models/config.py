"""The GPT architecture as data: everything ``models`` needs to build a decoder.

It lives here, not in the engine, because the model is built from it alone; the engine's config
embeds it as its ``model`` section.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional


def option(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with its one-line documentation attached."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kwargs)
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass
class ModelConfig:
    preset: Optional[str] = option(None, "Named architecture filled in before overrides: gpt2 or llama (None = fields as given)")
    num_layers: int = option(2, "Number of transformer blocks")
    hidden_size: int = option(64, "Width of the residual stream")
    num_heads: int = option(4, "Attention heads (query heads under grouped-query attention)")
    num_kv_heads: Optional[int] = option(None, "Key/value heads for grouped-query attention (None = num_heads)")
    ffn_hidden_size: Optional[int] = option(None, "MLP inner width (None = 4*hidden, or 8/3*hidden rounded to 64 for swiglu)")
    vocab_size: int = option(512, "Tokenizer vocabulary size before padding to a multiple of 128*tp (auto = data.tokenizer's)")
    seq_length: int = option(128, "Tokens per training sample")
    position_embedding: str = option("learned", "Position encoding: learned or rope")
    rope_theta: float = option(10000.0, "Rotary base frequency (rope only)")
    norm: str = option("layernorm", "Normalisation: layernorm or rmsnorm")
    norm_eps: float = option(1e-5, "Epsilon added inside the norm")
    activation: str = option("gelu", "MLP activation: gelu (tanh approximation, as GPT-2), gelu_exact (erf) or swiglu")
    tie_embeddings: bool = option(True, "Share the token embedding with the LM head")
    bias: bool = option(True, "Add biases to linear layers")
    dropout: float = option(0.0, "Dropout on embeddings, attention output and MLP output")
    attention_dropout: float = option(0.0, "Dropout on attention probabilities")
    init_std: Optional[float] = option(None, "Std of the normal initialisation (None = 1/sqrt(3*hidden), as MT-NLG)")

    @property
    def effective_init_std(self) -> float:
        """Explicit, else MT-NLG's width-dependent default 1/sqrt(3*hidden) (4e-3 at hidden 20480)."""
        return self.init_std or 1.0 / math.sqrt(3 * self.hidden_size)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        """Explicit, else 4h for GeLU or 8h/3 rounded up to a multiple of 64 for SwiGLU."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.activation == "swiglu":
            return -(-(8 * self.hidden_size // 3) // 64) * 64
        return 4 * self.hidden_size
