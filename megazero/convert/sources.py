"""What a conversion reads: a model config and its logical tensors, one at a time.

Every source (a megazero checkpoint of any layout, a Hugging Face folder, a Megatron-LM checkpoint)
offers the same three things: ``cfg`` (our ``ModelConfig``), ``names`` (our logical parameter
names in model order; a tied head is the embedding) and ``read(name)``: that parameter, whole, in
fp32, with exactly ``cfg.vocab_size`` vocabulary rows (padding stripped, so a target pads for its
own layout). A megazero source can also give the Adam moments (``read_state``) and the training
progress, for an offline reshard that keeps the optimizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Protocol

import torch

from megazero.checkpoint.format import resolve_checkpoint
from megazero.checkpoint.reader import CheckpointReader
from megazero.errors import UserError
from models import GPT
from models.config import ModelConfig
from models.embedding import VOCAB_MULTIPLE, fit_rows
from models.gpt import VOCAB_PADDED


HF_CONFIG_RECORD = "hf_config"
"""The meta key of what an import keeps of a Hugging Face folder's ``config.json`` for an export back,
where our model config holds nothing of it: the weights' ``torch_dtype`` and the family's ``KEPT``
keys (a GPT-2's name for its GeLU). A checkpoint a run trained records none: its weights are its own."""


class Source(Protocol):
    cfg: ModelConfig
    names: list[str]

    def read(self, name: str) -> torch.Tensor: ...


def logical_shapes(cfg: ModelConfig, vocab_multiple: int = VOCAB_MULTIPLE) -> dict[str, tuple[int, ...]]:
    """Our model's logical parameters and full shapes, in model order (built on the meta device: no
    memory), with the vocabulary padded to ``vocab_multiple``."""
    model = GPT(cfg, vocab_multiple=vocab_multiple, device="meta")
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def finite(t: torch.Tensor, where: str) -> torch.Tensor:
    """``t``, refused where it holds a NaN or an infinity (``where`` names the file and tensor): such
    weights come from a damaged file or a diverged run, and a model started from them, exported or
    sampled from computes NaN from its first token on, far from the load that could have said so."""
    if t.is_floating_point() and not torch.isfinite(t).all():
        bad = int(t.numel() - torch.isfinite(t).sum())
        raise UserError(f"{where}: holds {bad} NaN or infinite values of {t.numel()}; the checkpoint is damaged "
                        "or its run diverged -- use another copy or an earlier checkpoint")
    return t


def unpadded(name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    return fit_rows(t, cfg.vocab_size) if name in VOCAB_PADDED else t


class MegazeroSource:
    """A megazero training checkpoint of any layout (tp, pp, dp, virtual stages, ZeRO stage)."""

    kind = "megazero"

    def __init__(self, path, verify: bool = True):
        from megazero.config.loader import build_dataclass

        self.ckpt = resolve_checkpoint(path, source="the SRC argument")
        self.reader = CheckpointReader(self.ckpt, verify=verify)
        saved = self.reader.meta.get("config")
        if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
            raise UserError(f"{self.ckpt}: records no model config, so it was not saved by `megazero train` or "
                            "`megazero convert`; check the SRC argument")
        self.cfg = build_dataclass(ModelConfig, saved["model"], prefix="model.")
        self.names = list(logical_shapes(self.cfg))
        self._check_shapes()

    def _check_shapes(self) -> None:
        """The files hold exactly the parameters the recorded config describes, each of the shape it
        implies (the vocabulary padded for the tp the files were written at), before anything is
        converted: otherwise a head beside ``tie_embeddings`` would be dropped, vocabulary rows cut
        or zero-filled to the recorded ``vocab_size``, and other sizes fail deep in the conversion."""
        tp = max((shard.count for index in self.reader.ranks for _, _, shard in index.params if shard is not None),
                 default=1)
        expected = logical_shapes(self.cfg, vocab_multiple=VOCAB_MULTIPLE * tp)
        missing = [n for n in expected if n not in self.reader.shapes]
        if missing:
            raise UserError(f"{self.ckpt}: holds no parameter {missing[0]!r} of the model its config describes; "
                            "the checkpoint is damaged -- load another one")
        extra = [n for n in self.reader.shapes if n not in expected]
        if extra:
            raise UserError(f"{self.ckpt}: holds parameter {extra[0]!r}, which the model its config describes does "
                            "not have; the checkpoint is damaged -- load another one")
        for name, shape in expected.items():
            if self.reader.shapes[name] != shape:
                raise UserError(f"{self.ckpt}: parameter {name!r} has shape {list(self.reader.shapes[name])} where "
                                f"its config implies {list(shape)}; the checkpoint is damaged -- load another one")

    def read(self, name: str) -> torch.Tensor:
        return finite(unpadded(name, self.reader.read(name)["master"], self.cfg), f"{self.ckpt}: parameter {name!r}")

    def read_state(self, name: str, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
        return {k: finite(unpadded(name, t, self.cfg), f"{self.ckpt}: parameter {name!r} ({k})")
                for k, t in self.reader.read(name, keys).items()}

    def optimizer_scalars(self) -> tuple[float, Optional[dict]]:
        """The Adam step (the largest over ranks: a rank whose shard was all padding saved 0) and rank
        0's loss-scaler state."""
        steps = [float(self.reader.values(r, ("adam_step",))["adam_step"]) for r in range(self.reader.world_size)]
        return max(steps), self.reader.values(0, ("scaler",))["scaler"]


def source_meta(source) -> dict:
    """What a megazero checkpoint's manifest records beside its tensors; for other sources what they
    tell of the same (a Hugging Face folder: its tokenizer's record and ``HF_CONFIG_RECORD``), else {}."""
    return getattr(getattr(source, "reader", None), "meta", None) or getattr(source, "meta", None) or {}


def fresh_config(source):
    """The training config recorded for ``source``'s weights where no run of ours recorded one: the
    defaults around its model section, and the tokenizer that came with the weights (``tokenizer_path``
    of a Hugging Face folder), so that a run, ``generate`` or an export back finds it."""
    from megazero.config.schema import Config, DataConfig

    return Config(model=source.cfg, data=DataConfig(tokenizer=getattr(source, "tokenizer_path", None)))


def detect(path: Path) -> str:
    """The kind of checkpoint at ``path``, from its files: megazero, hf or megatron."""
    from megazero.checkpoint.format import COMPLETE, STEP_DIR

    if (path / "config.json").is_file():
        return "hf"
    if (path / "latest_checkpointed_iteration.txt").is_file() or path.name.startswith("iter_") or \
            any(p.name.startswith("iter_") for p in path.glob("iter_*")):
        return "megatron"
    if (path / COMPLETE).is_file() or (path / "latest").is_file() or \
            any(STEP_DIR.match(p.name) for p in path.iterdir()):
        return "megazero"
    raise UserError(f"{path}: not a megazero checkpoint (step_* directories), a Hugging Face folder (config.json) "
                    "or a Megatron-LM checkpoint (iter_* directories); check SRC or name its kind with --from")
