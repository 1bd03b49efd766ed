"""The megazero targets: a training checkpoint (consolidated, or in a run's own layout) and a
single-file state dict.

A checkpoint written here starts training where the source left off when the source is a megazero
checkpoint (step, consumed samples, Adam moments and step, loss scale, the training shards' digests:
an offline reshard), and
from step 0 with fresh optimizer state otherwise (or with ``reset_step``): zero moments, Adam step
0, and the data order of a new run (consumed samples 0). Its recorded training config is the
source's, or a default one around the source's model section, so ``megazero train`` refuses a run
whose model section differs (preflight names the field) and ``megazero generate`` can sample from it.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch

from megazero.config.schema import Config
from megazero.convert.checkpoint_out import write_checkpoint
from megazero.convert.layout import consolidated, training_layout
from megazero.convert.sources import HF_CONFIG_RECORD, Source, fresh_config, logical_shapes, source_meta
from megazero.convert.streaming import StreamedSafetensors
from models.embedding import fit_rows
from models.gpt import VOCAB_PADDED

STATE_DICT_METADATA = "megazero.model_config"


def write_megazero(source: Source, root: Path, reset_step: bool = False, run: Optional[Config] = None) -> Path:
    """Write ``source`` as a checkpoint under ``root``, laid out for the run ``run`` (a validated
    config with the source's model section: each of its ranks gets the file it would write), or
    consolidated without one; returns the step directory."""
    cfg = source.cfg
    if run is None:
        shapes = logical_shapes(cfg)
        layout = consolidated(shapes, cfg.num_layers)
    else:
        shapes = logical_shapes(cfg, vocab_multiple=128 * run.parallel.tp)
        layout = training_layout(run)
    carry = getattr(source, "kind", None) == "megazero" and not reset_step

    def read(name: str, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
        values = source.read_state(name, keys) if carry else {"master": source.read(name)}
        return {k: fit_rows(v, shapes[name][0]) if name in VOCAB_PADDED else v for k, v in values.items()}

    if carry:
        saved = source.reader.meta
        carried = ("step", "consumed", "skipped", "bad_in_row", "config", "shards", "shard_tokens", "blend_rule",
                   "train_samples")
        meta = {key: saved[key] for key in carried if key in saved}
        adam_step, scaler = source.optimizer_scalars()
    else:
        meta = {"step": 0, "consumed": 0, "skipped": 0, "bad_in_row": 0, "config": asdict(fresh_config(source))}
        adam_step, scaler = 0.0, None
    if run is not None:
        meta["config"] = asdict(run)
    record = source_meta(source).get("tokenizer")
    if record is not None:  # the weights still take the ids of the tokenizer they were trained on
        meta["tokenizer"] = record
    kept = source_meta(source).get(HF_CONFIG_RECORD)
    if kept:  # still the imported weights: an export back writes them as the folder had them
        meta[HF_CONFIG_RECORD] = kept
    return write_checkpoint(root, layout, read, step=int(meta["step"]), meta=meta, with_moments=carry,
                            adam_step=adam_step, scaler=scaler)


def write_state_dict(source: Source, path: Path) -> None:
    """Every logical parameter, fp32, vocabulary unpadded, in one safetensors file under our names
    (a tied head is ``embedding.tokens.weight``); the model config is JSON in its metadata
    (``STATE_DICT_METADATA``), so the file describes itself."""
    cfg = source.cfg
    declared = {name: torch.empty((cfg.vocab_size, *shape[1:]) if name in VOCAB_PADDED else shape, device="meta")
                for name, shape in logical_shapes(cfg).items()}
    out = StreamedSafetensors(path, declared, {"format": "pt", STATE_DICT_METADATA: json.dumps(asdict(cfg))})
    for name in declared:
        out.write(source.read(name))
    out.close()
