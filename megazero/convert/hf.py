"""Hugging Face folders: reading one as a source, and writing one from any source.

Written: ``config.json`` and ``generation_config.json``, the weights as safetensors shards with
``model.safetensors.index.json`` (one ``model.safetensors`` when they fit one shard), and the
tokenizer (``megazero.convert.hf_tokenizer``). The folder loads with
``AutoModelForCausalLM.from_pretrained`` and no custom code.

Read: the same files. Weights only from safetensors: a ``pytorch_model.bin`` is a pickle, which
can run code when loaded, and is refused with the fix. Before anything is written, ``config.json``
is checked as `megazero train` checks a model section, and the weights against it: the tensors it
implies, each of the shape it implies, and no others.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

from megazero.convert.hf_models import FAMILIES, check_model_type, family_for
from megazero.convert.hf_tokenizer import ExportTokenizer, import_notes, write_tokenizer
from megazero.convert.sources import HF_CONFIG_RECORD, Source, finite, logical_shapes, source_meta
from megazero.convert.streaming import StreamedSafetensors
from megazero.errors import UserError
from models.config import ModelConfig
from models.embedding import fit_rows
from models.gpt import VOCAB_PADDED

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
HEADER_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


class HFSource:
    """A Hugging Face model folder (``config.json`` and safetensors weights)."""

    kind = "hf"

    def __init__(self, folder):
        self.folder = Path(folder)
        config_path = self.folder / "config.json"
        try:
            self.hf = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise UserError(f"{config_path}: cannot be read as JSON ({e}); check SRC") from None
        if not isinstance(self.hf, dict):
            raise UserError(f"{config_path}: holds a {type(self.hf).__name__}, not a mapping of fields; check SRC")
        archs = self.hf.get("architectures") or []
        if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
            raise UserError(f"{config_path}: architectures is {archs!r}, not a list of class names; check SRC")
        # transformers builds the class model_type names (AutoModelForCausalLM), so a config without
        # architectures (a bare LlamaConfig().save_pretrained) is read by its model_type
        by_type = {f.model_type: f for f in FAMILIES.values()}
        self.family = FAMILIES.get(archs[0]) if archs else by_type.get(self.hf.get("model_type"))
        if self.family is None:
            raise UserError(f"{config_path}: architecture {archs[0] if archs else self.hf.get('model_type')!r} is not "
                            f"one megazero can import ({', '.join(FAMILIES)}); convert such a model with its own tools")
        check_model_type(self.hf, self.family, str(config_path))
        self.cfg = without_derived_init_std(self.family.model_config(self.hf, str(config_path)))
        self.files = self._weight_files()
        self.stored = self._stored_names()
        dtypes = self._check_weights(hf_shapes(self.cfg, self.family))
        self.names = list(logical_shapes(self.cfg))
        self.tokenizer_path, record = self._tokenizer()
        self.meta = {**record, HF_CONFIG_RECORD: self._kept(dtypes)}

    def _kept(self, dtypes: set[str]) -> dict:
        """What an export back writes as this folder has it: the weights' dtype, from ``dtype`` (older
        files: ``torch_dtype``; ``transformers`` reads the first) or else from the tensors where all have
        one (without it a bf16 model came back fp32, twice the size, and loaded as another precision),
        and the family's ``KEPT`` keys."""
        kept = {key: self.hf[key] for key in self.family.KEPT if key in self.hf}
        dtype = self.hf.get("dtype") if self.hf.get("dtype") is not None else self.hf.get("torch_dtype")
        if dtype not in HF_DTYPE_NAMES.values() and len(dtypes) == 1:
            dtype = HEADER_DTYPES.get(next(iter(dtypes)))
        if dtype in HF_DTYPE_NAMES.values():
            kept["torch_dtype"] = dtype
        return kept

    def _tokenizer(self) -> tuple[Optional[str], dict]:
        """The folder's tokenizer (``tokenizer.json``, else a SentencePiece ``tokenizer.model``) and its
        record as a checkpoint keeps it (``tokenizer_identity``): these weights take its ids, so a run
        from the import on data of another tokenizer is refused, and an export back writes it. A
        folder without one megazero can read imports with a note and no record."""
        from data_pipeline.shard_origin import tokenizer_identity
        from data_pipeline.tokenizer import load_tokenizer

        found = [self.folder / name for name in ("tokenizer.json", "tokenizer.model") if (self.folder / name).is_file()]
        for path in found:
            try:
                tokenizer = load_tokenizer(str(path))
                record = {"tokenizer": tokenizer_identity(tokenizer)}
            except (ValueError, OSError) as exc:
                print(f"megazero convert: note: {path}: not read as a tokenizer ({exc})", flush=True)
                continue
            for note in import_notes(self.folder, path, tokenizer, self.hf):
                print(f"megazero convert: note: {note}", flush=True)
            return str(path.resolve()), record
        print(f"megazero convert: note: {self.folder}: no tokenizer megazero can read (tokenizer.json or a "
              "SentencePiece tokenizer.model); the checkpoint records none: give data.tokenizer the one the model "
              "was trained with", flush=True)
        return None, {}

    def _weight_files(self) -> dict[str, str]:
        """Tensor name -> shard file name, from the index or the single file."""
        index = self.folder / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise UserError(f"{index}: is not a safetensors index ({type(e).__name__}: {e}); restore it") from None
            if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
                raise UserError(f"{index}: weight_map is not a mapping of tensor names to shard files; restore it")
            if (self.folder / "model.safetensors").is_file() and set(weight_map.values()) != {"model.safetensors"}:
                # transformers loads model.safetensors and ignores the index: which set is stale?
                raise UserError(f"{self.folder}: holds both model.safetensors and {INDEX} naming other shards, "
                                "which may hold different weights; remove the set that is stale")
        elif (self.folder / "model.safetensors").is_file():
            weight_map = {name: "model.safetensors" for name in _header(self.folder / "model.safetensors")}
        elif any(self.folder.glob("pytorch_model*.bin")):
            raise UserError(f"{self.folder}: holds pytorch_model.bin, a pickle that can run code when loaded, and "
                            "no safetensors weights; save the model with safetensors first "
                            "(model.save_pretrained(folder) does by default)")
        else:
            raise UserError(f"{self.folder}: holds no model.safetensors or {INDEX}; check SRC")
        for shard in sorted(set(weight_map.values())):
            if not (self.folder / shard).is_file():
                raise UserError(f"{self.folder / shard}: weight shard listed in {INDEX} is missing; "
                                "download it again")
        return weight_map

    def _stored_names(self) -> dict[str, str]:
        """Each tensor's name as the causal-LM class names it -> its name in the files. A folder saved
        from the bare base model (no name starts with the family's ``base_model_prefix``) is read as
        ``transformers`` reads it: every name under that prefix; a head it lacks is missing."""
        prefix = f"{self.family.BASE}."
        if any(name.startswith(prefix) for name in self.files):
            return {name: name for name in self.files}
        return {prefix + name: name for name in self.files}

    def _check_weights(self, expected: dict[str, tuple[int, ...]]) -> set[str]:
        """The weights are what config.json says, before anything is converted: every tensor it
        implies is there, in a float dtype, with the shape it implies (vocabulary rows included:
        a Hugging Face embedding has exactly vocab_size rows, padding counted in vocab_size), and
        no weight is left that it does not use (a layer beyond n_layer, a head of a tied model),
        rather than dropped, cut or zero-filled into a model that is not the one in the folder.
        Returns their dtypes (``F32``, ...)."""
        found = {}
        for shard in sorted(set(self.files.values())):
            header = _header(self.folder / shard)
            unlisted = [name for name in header if self.files.get(name) != shard]
            if unlisted:  # a tensor the index leaves out would be dropped unseen (a head beside a tied config)
                raise UserError(f"{self.folder / shard}: holds tensor {unlisted[0]!r}, which {INDEX} does not list "
                                f"in it; the index does not match its shards -- restore it")
            found.update({name: (shard, *header[stored]) for name, stored in self.stored.items() if stored in header})
        missing = [name for name in expected if name not in found]
        if missing:
            raise UserError(f"{self.folder}: has no tensor {missing[0]!r} ({len(missing)} missing in all), which its "
                            "config.json implies; the weights do not match the config")
        unused = [name for name in found if name not in expected
                  and not any(buffer.fullmatch(name) for buffer in self.family.BUFFERS)]
        if unused:
            raise UserError(f"{self.folder}: holds {len(unused)} tensor(s) its config.json does not use "
                            f"({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}); the weights do not match "
                            "the config -- correct config.json or use the folder the weights came from")
        for name, shape in expected.items():
            shard, got, dtype = found[name]
            if got != shape:
                raise UserError(f"{self.folder / shard}: tensor {name} has shape {list(got)} where config.json "
                                f"implies {list(shape)}; the weights do not match the config")
            if dtype not in FLOAT_DTYPES:
                raise UserError(f"{self.folder / shard}: tensor {name} is {dtype}, not a float type "
                                f"({', '.join(FLOAT_DTYPES)}); a quantized model cannot be imported, use its "
                                "unquantized weights")
        return {found[name][2] for name in expected}

    def _tensor(self, name: str) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        stored = self.stored[name]
        shard = self.files[stored]
        try:
            with safe_open(self.folder / shard, framework="pt") as f:
                tensor = f.get_tensor(stored).float()
        except SafetensorError as e:
            raise UserError(f"{self.folder / shard}: cannot be read ({e}); the file is truncated or damaged -- "
                            "download it again") from None
        return finite(tensor, f"{self.folder / shard}: tensor {name}")

    def read(self, name: str) -> torch.Tensor:
        return self.family.from_hf(name, self._tensor, self.cfg)


def without_derived_init_std(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with ``init_std`` unset where its ``initializer_range`` is the std an unset one derives:
    export writes that derived std, so a config that left it unset comes back unset from a round
    trip, not pinned to the width it was exported at. Compared within rounding: an older export
    computed the same std another way, an ulp apart at some widths."""
    derived = replace(cfg, init_std=None)
    return derived if math.isclose(cfg.effective_init_std, derived.effective_init_std) else cfg


def _header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of a safetensors file with its shape and dtype (``F32``, ...), from the header alone."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            return {name: (tuple(s.get_shape()), s.get_dtype()) for name, s in slices.items()}
    except SafetensorError as e:
        raise UserError(f"{path}: cannot be read ({e}); the file is truncated or damaged -- download it again") from None


def write_hf(source: Source, out: Path, dtype: str = "fp32", tokenizer: Optional[ExportTokenizer] = None,
             shard_bytes: int = 5 << 30) -> None:
    """Write ``source`` as a Hugging Face folder into ``out`` (an empty directory), with ``tokenizer``
    (``hf_tokenizer.load_fitting``) when given."""
    cfg = source.cfg
    family = family_for(cfg)  # refuses an inexpressible architecture before anything is written
    torch_dtype = DTYPES[dtype]
    ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None,  # not GPT-2's or Llama's defaults
           **(tokenizer.ids if tokenizer is not None else {})}
    config = {"architectures": [family.hf_class], "model_type": family.model_type, "vocab_size": cfg.vocab_size,
              **family.hf_config(cfg, _record(source)), "tie_word_embeddings": cfg.tie_embeddings,
              "initializer_range": cfg.effective_init_std,
              "torch_dtype": HF_DTYPE_NAMES[torch_dtype], "use_cache": True, **ids}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"_from_model_config": True, **ids}, indent=2) + "\n")
    shapes = hf_shapes(cfg, family)
    shards = _plan_shards(shapes, torch_dtype, shard_bytes)
    files = sorted(set(shards.values()))
    writers: dict[str, StreamedSafetensors] = {}  # a shard is opened at its first tensor, closed after its last
    pending = {file: sum(1 for f in shards.values() if f == file) for file in files}
    for name in source.names:
        for hf_name, t in family.to_hf(name, source.read(name), cfg):
            file = shards[hf_name]
            if file not in writers:
                declared = {n: torch.empty(shapes[n], dtype=torch_dtype, device="meta")
                            for n, f in shards.items() if f == file}
                writers[file] = StreamedSafetensors(out / file, declared, {"format": "pt"})
            writers[file].write(t)
            pending[file] -= 1
            if pending[file] == 0:
                writers.pop(file).close()
    total = sum(math.prod(s) for s in shapes.values()) * torch.finfo(torch_dtype).bits // 8
    if len(files) > 1:
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": shards}, indent=2))
    if tokenizer is not None:
        write_tokenizer(tokenizer, out)


def imported_dtype(source: Source) -> Optional[str]:
    """The dtype (fp32, bf16, fp16) of the Hugging Face weights ``source`` was imported from, as its
    record (``HF_CONFIG_RECORD``) has it; None for weights a run trained or another framework's."""
    name = _record(source).get("torch_dtype")
    return next((ours for ours, t in DTYPES.items() if HF_DTYPE_NAMES[t] == name), None)


def _record(source: Source) -> dict:
    record = source_meta(source).get(HF_CONFIG_RECORD)
    return record if isinstance(record, dict) else {}


def hf_shapes(cfg: ModelConfig, family) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensors of a model of ``cfg``, in the order they are written, with their
    shapes: what export writes and import requires (the maps run on meta tensors, so shapes come
    from the same code as values)."""
    shapes = {}
    for name, shape in logical_shapes(cfg).items():
        t = torch.empty(shape, device="meta")
        t = fit_rows(t, cfg.vocab_size) if name in VOCAB_PADDED else t
        for hf_name, out in family.to_hf(name, t, cfg):
            shapes[hf_name] = tuple(out.shape)
    return shapes


def _plan_shards(shapes: dict, dtype: torch.dtype, shard_bytes: int) -> dict[str, str]:
    """Tensor -> shard file: consecutive tensors up to ``shard_bytes`` a file (a larger tensor alone)."""
    groups, size = [[]], 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * torch.finfo(dtype).bits // 8
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        return {name: "model.safetensors" for name in groups[0]}
    n = len(groups)
    return {name: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, group in enumerate(groups) for name in group}

