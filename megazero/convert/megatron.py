"""Megatron-LM's legacy ``torch`` checkpoints as a conversion source.

Layout: ``ROOT/latest_checkpointed_iteration.txt`` and ``ROOT/iter_NNNNNNN/mp_rank_TT[_PPP]/
model_optim_rng.pt``, one file per tensor rank ``TT`` and pipeline rank ``PPP`` (no ``_PPP`` when
there is one stage), each a pickle holding ``args`` (an ``argparse.Namespace``) and ``model``
(megatron-core ``GPTModel`` state dict of that rank's stage, layers numbered from 0 in each stage).

Loading runs no code from the file: ``torch.load(weights_only=True)`` with ``argparse.Namespace``
allowed, and every other class the pickle names (Megatron's enums in ``args``, say) replaced by an
inert stand-in that only records its arguments. Files are memory-mapped, so a tensor's bytes are
read when it is converted.

Layouts that match ours: megatron-core's fused ``linear_qkv`` rows are grouped by query group
(the group's query heads, then its key, then its value), as ours, and split over tp at group
boundaries, so the tp slices concatenate into our tensor. Its SwiGLU ``linear_fc1`` holds, per tp
rank, that rank's gate rows then its up rows; ours interleaves them. Tensors every tp rank holds
whole are read from tp rank 0, after checking the other ranks hold the same values.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from types import SimpleNamespace

import torch

from data_pipeline.typed_config import coerce, field_types
from megazero.convert.hf_models import LAYER, refuse, validated
from megazero.convert.sources import finite, logical_shapes, unpadded
from megazero.errors import UserError
from models.config import ModelConfig
from models.gpt import VOCAB_PADDED

RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
FILE = "model_optim_rng.pt"


class _Inert:
    """Stands in for a class a Megatron pickle names (outside the model weights): keeps its arguments."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state


def safe_load(path: Path) -> dict:
    """``torch.load`` that cannot run code: see the module docstring."""
    from torch.serialization import get_unsafe_globals_in_checkpoint, safe_globals

    try:
        names = get_unsafe_globals_in_checkpoint(str(path))
        allowed = [argparse.Namespace if n == "argparse.Namespace" else (_Inert, n) for n in names]
        with safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a damaged or foreign file
        raise UserError(f"{path}: cannot be read as a Megatron checkpoint ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); the file is truncated or damaged") from None


def iteration_dir(path: Path) -> Path:
    if path.name.startswith("iter_"):
        return path
    tracker = path / "latest_checkpointed_iteration.txt"
    if tracker.is_file():  # Megatron-LM loads what it names, or fails: so does the import, not another one
        text = tracker.read_text(errors="replace").strip()
        if not ((text.isascii() and text.isdigit()) or text == "release"):  # int() refuses "²"
            raise UserError(f"{tracker}: holds {text[:40]!r}, not an iteration number or 'release'; give the "
                            "iter_* directory to import as SRC")
        named = path / (f"iter_{int(text):07d}" if text.isdigit() else "release")
        if not named.is_dir():
            raise UserError(f"{tracker}: names {named.name}, which {path} does not hold; give an iter_* directory "
                            "it holds as SRC, or restore that one")
        return named
    found = sorted(path.glob("iter_*"))
    if not found:
        raise UserError(f"{path}: holds no iter_* directory; check SRC")
    return found[-1]


class MegatronSource:
    kind = "megatron"

    def __init__(self, path, vocab_size: int | None = None):
        self.dir = iteration_dir(Path(path))
        files = {}
        for sub in self.dir.iterdir() if self.dir.is_dir() else ():
            match = RANK_DIR.match(sub.name)
            if match:
                files[(int(match.group(1)), int(match.group(2) or 0))] = sub / FILE
        if not files and any(self.dir.glob("*.distcp")):
            raise UserError(f"{self.dir}: is a torch_dist checkpoint (*.distcp files), Megatron-LM's distributed "
                            "format; only its legacy torch format is read: save it again with Megatron-LM's "
                            "--ckpt-convert-format torch --ckpt-convert-save DIR and convert DIR")
        if not files:
            raise UserError(f"{self.dir}: holds no mp_rank_* directories; check SRC")
        self.tp = 1 + max(t for t, _ in files)
        self.pp = 1 + max(p for _, p in files)
        for t in range(self.tp):
            for p in range(self.pp):
                if not files.get((t, p), Path("/nonexistent")).is_file():
                    raise UserError(f"{self.dir / rank_dir(t, p, self.pp) / FILE}: missing (tp rank {t}, pipeline rank "
                                    f"{p} of {self.tp} x {self.pp}); restore it")
        self.files, self._loaded = files, {}
        first = self._state(0, 0)
        self.args = first.get("args")
        if not isinstance(self.args, argparse.Namespace):
            raise UserError(f"{files[(0, 0)]}: records no Megatron args; cannot tell its architecture")
        self._check_rank_grid()
        self.cfg = model_config(self.args, str(files[(0, 0)]), vocab_size)
        self.padded = _whole(self.args, "padded_vocab_size", str(files[(0, 0)]))
        self.offsets = self._layer_offsets()
        self.names = list(logical_shapes(self.cfg))
        self._check_shapes()
        self._check_every_tensor_used()

    def _check_rank_grid(self) -> None:
        """The tp x pp of the rank directories against the one the args record: a save whose last tp
        ranks or stages were lost (or a folder holding another save's extra ranks) was otherwise
        refused for the shape of its first split tensor, or for its count of layers, as weights that
        do not match their args. Args that record neither (hand-made ones) are not compared."""
        stated = {"tensor_model_parallel_size": self.tp, "pipeline_model_parallel_size": self.pp}
        for key, found in stated.items():
            recorded = getattr(self.args, key, None)
            if isinstance(recorded, int) and recorded != found:
                raise UserError(f"{self.dir}: holds the rank directories of tp {self.tp} x pp {self.pp}, but its args "
                                f"record args.{key} {recorded}; restore the missing mp_rank_* directories, or remove "
                                "those another save left")

    def _state(self, t: int, p: int) -> dict:
        if (t, p) not in self._loaded:
            state = safe_load(self.files[(t, p)])
            if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
                path = self.files[(t, p)]
                chunks = [k for k in state if str(k).startswith("model")] if isinstance(state, dict) else []
                if chunks:
                    raise UserError(f"{path}: holds {', '.join(chunks)} (a virtual-pipeline checkpoint's model "
                                    "chunks); only one model chunk per rank can be imported")
                raise UserError(f"{path}: holds no 'model' weights (tp rank {t}, pipeline rank {p}); the checkpoint "
                                "is damaged or not Megatron-LM's: restore that file")
            if "language_model" in state["model"]:  # else refused as missing megatron-core's keys, as if damaged
                raise UserError(f"{self.files[(t, p)]}: holds a pre-megatron-core model (language_model.*); only "
                                "megatron-core's GPTModel is read: convert it to that layout with Megatron-LM's "
                                "tools/checkpoint/convert.py first")
            stray = next(((k, v) for k, v in state["model"].items() if not isinstance(k, str) or not (
                isinstance(v, torch.Tensor) or k.endswith("._extra_state"))), None)
            if stray is not None:  # else a traceback where its shape or name is first looked at
                raise UserError(f"{self.files[(t, p)]}: its 'model' maps {stray[0]!r} to a {type(stray[1]).__name__}, "
                                f"where megatron-core saves weight names and tensors (tp rank {t}, pipeline rank {p}); "
                                "the checkpoint is damaged or not Megatron-LM's: restore that file")
            self._loaded[(t, p)] = state
        return self._loaded[(t, p)]

    def _model(self, t: int, p: int) -> dict:
        return self._state(t, p)["model"]

    def _layer_offsets(self) -> list[int]:
        """The global index of each stage's layer 0: the layers of the stages before it."""
        offsets, total = [], 0
        for p in range(self.pp):
            offsets.append(total)
            total += len({int(m.group(1)) for k in self._model(0, p) if (m := re.match(r"decoder\.layers\.(\d+)\.", k))})
        if total != self.cfg.num_layers:
            raise UserError(f"{self.dir}: its stages hold {total} layers but args.num_layers is {self.cfg.num_layers}; "
                            "the checkpoint is incomplete")
        return offsets

    def _pieces(self, p: int, key: str) -> list[torch.Tensor]:
        """Each tp rank's ``key`` (there and shaped: ``_check_shapes``), refused where it is not finite,
        naming the rank file that holds it."""
        return [finite(self._model(t, p)[key].float(), f"{self.files[(t, p)]}: {key}") for t in range(self.tp)]

    def _replicated(self, p: int, key: str) -> torch.Tensor:
        """A tensor each tp rank holds whole: tp rank 0's copy. Training keeps the copies equal; if
        they differ, each rank computed with its own and no single copy gives Megatron's outputs, so
        the conversion says so."""
        first, *others = self._pieces(p, key)
        worst = max(((other - first).abs().max().item() for other in others), default=0.0)
        if worst > 0:
            print(f"megazero convert: note: {self.dir}: the tp ranks of pipeline rank {p} hold different copies of "
                  f"{key} (largest difference {worst:.3g}); tp rank 0's is imported, so outputs will differ from "
                  "Megatron's", flush=True)
        return first

    def _layer(self, index: int) -> tuple[int, int]:
        p = max(s for s in range(self.pp) if self.offsets[s] <= index)
        return p, index - self.offsets[p]

    def read(self, name: str) -> torch.Tensor:
        return unpadded(name, self._read(name), self.cfg)

    def _read(self, name: str) -> torch.Tensor:
        p, key, split = self._locate(name)
        if split == "whole":
            return self._replicated(p, key)
        pieces = self._pieces(p, key)
        if split == "swiglu":
            gates, ups = zip(*(piece.chunk(2) for piece in pieces))
            return torch.stack([torch.cat(gates), torch.cat(ups)], dim=1).flatten(0, 1)
        return torch.cat(pieces, dim=1 if split == "columns" else 0)

    def _locate(self, name: str) -> tuple[int, str, str]:
        """Where our parameter ``name`` is in the checkpoint: the pipeline rank, Megatron's key and how
        its tp ranks hold it (``core_key``). A layer's norm may be fused into the linear after it
        (Transformer Engine's layer spec)."""
        layer, key, split = core_key(name, self.cfg.activation == "swiglu")
        if layer is None:
            return (0 if key.startswith("embedding.") else self.pp - 1), key, split
        p, local = self._layer(layer)
        own = f"decoder.layers.{local}.{key}"
        norm, leaf = key.rsplit(".", 1)
        if norm in FUSED_NORM and own not in self._model(0, p):
            return p, f"decoder.layers.{local}.{FUSED_NORM[norm]}.layer_norm_{leaf}", split
        return p, own, split

    def _check_shapes(self) -> None:
        """Every tensor the args imply, on every tp rank, of the shape they imply, before anything is
        written (the files are memory-mapped: shapes cost no reads). A mismatch would otherwise stop
        the writer half-way with a traceback, or, for a vocabulary short of rows, be filled with zeros."""
        for name, shape in logical_shapes(self.cfg).items():
            p, key, split = self._locate(name)
            vocab = name in VOCAB_PADDED
            for t in range(self.tp):
                model = self._model(t, p)
                if key not in model:
                    raise UserError(f"{self.files[(t, p)]}: has no {key!r}, which args imply; the checkpoint does "
                                    "not match its args")
                got, want = tuple(model[key].shape), list(shape)
                if vocab and self.padded is not None:  # the padded rows the args record, split over tp
                    want[0] = self.padded // self.tp if self.padded % self.tp == 0 else self.padded / self.tp
                elif vocab:  # padded rows, as many on each rank, covering the vocabulary
                    want[0] = max(self._model(0, p)[key].shape[0], -(-self.cfg.vocab_size // self.tp))
                elif split != "whole":
                    dim = 1 if split == "columns" else 0
                    want[dim] = shape[dim] // self.tp if shape[dim] % self.tp == 0 else shape[dim] / self.tp
                if got != tuple(want):
                    of = f" (tp rank {t} of {self.tp})" if split != "whole" else ""
                    raise UserError(f"{self.files[(t, p)]}: {key} has shape {list(got)} where its args imply "
                                    f"{want}{of}; the weights do not match their args")
                if not model[key].is_floating_point():
                    raise UserError(f"{self.files[(t, p)]}: {key} holds {model[key].dtype}, not floating-point "
                                    "weights; the file is not a model checkpoint")


    def _check_every_tensor_used(self) -> None:
        """A weight the args do not account for would be dropped without a word: above all a head
        (``output_layer.weight``) beside args that tie it to the embedding, where the embedding would
        be imported in its place. Megatron's per-module ``_extra_state`` (no weights) is skipped. With
        a pipeline, a tied model's last stage keeps a copy of the embedding as its head: it must equal
        the embedding's."""
        used = {}
        for name in self.names:
            p, key, _ = self._locate(name)
            used.setdefault(p, set()).add(key)
        tied = self.cfg.tie_embeddings
        for (t, p), path in sorted(self.files.items()):
            for key in self._model(t, p):
                if key in used.get(p, ()) or key.endswith("._extra_state"):
                    continue
                if key == "output_layer.weight" and tied and self.pp > 1 and p == self.pp - 1:
                    if not torch.equal(self._model(t, p)[key], self._model(t, 0)["embedding.word_embeddings.weight"]):
                        raise UserError(f"{path}: output_layer.weight differs from the embedding of "
                                        f"{self.files[(t, 0)]}, but args tie them (no "
                                        "args.untie_embeddings_and_output_weights); the checkpoint does not match its "
                                        "args")
                    continue
                if self._is_norm_bias_without_linear_biases(key):
                    self._require_zero(t, p, key)
                    continue
                why = (" (args tie the head to the embedding: no args.untie_embeddings_and_output_weights)"
                       if key == "output_layer.weight" else "")
                raise UserError(f"{path}: holds {key!r}, which its args do not account for{why}; it would be "
                                "dropped: the checkpoint does not match its args")


    def _is_norm_bias_without_linear_biases(self, key: str) -> bool:
        """Whether ``key`` is a LayerNorm bias of a model without linear biases: megatron-core's LayerNorm
        keeps its bias under ``--disable-bias-linear``; megazero's ``model.bias false`` has none."""
        return not self.cfg.bias and self.cfg.norm == "layernorm" and key.endswith(("layernorm.bias", "layer_norm_bias"))

    def _require_zero(self, t: int, p: int, key: str) -> None:
        """A zero norm bias is exactly none, and is left out; a trained, non-zero one is refused: imported
        without it, every norm's output would move."""
        if torch.count_nonzero(self._model(t, p)[key]):
            raise UserError(f"{self.files[(t, p)]}: holds {key}, a LayerNorm bias that is not zero, beside "
                            "args.add_bias_linear False; megazero's model.bias false has no norm biases, so such a "
                            "model cannot be imported")


FUSED_NORM = {"input_layernorm": "self_attention.linear_qkv", "pre_mlp_layernorm": "mlp.linear_fc1"}
"""The linear a layer's norm is fused into under Transformer Engine's layer spec (``layer_norm_weight``)."""

LINEARS = {"attention.qkv": "self_attention.linear_qkv", "attention.out": "self_attention.linear_proj",
           "mlp.fc_in": "mlp.linear_fc1", "mlp.fc_out": "mlp.linear_fc2"}


def core_key(name: str, swiglu: bool) -> tuple[int | None, str, str]:
    """Where megatron-core's ``GPTModel`` (local layer spec) keeps our parameter ``name``: our layer
    index (None outside the layers), its key (for a layer, the part after ``decoder.layers.N.``, N
    counted within the layer's stage), and how the tp ranks hold it: ``whole`` (each a copy),
    ``rows`` or ``columns`` (each a slice of that dimension; the vocabulary's rows padded),
    ``swiglu`` (each its slice of the gate rows, then its slice of the up rows; ours interleaves them)."""
    module, leaf = name.rsplit(".", 1)
    top = {"embedding.tokens": ("embedding.word_embeddings.weight", "rows"),
           "embedding.positions": ("embedding.position_embeddings.weight", "whole"),
           "final_norm": (f"decoder.final_layernorm.{leaf}", "whole"), "lm_head": ("output_layer.weight", "rows")}
    if module in top:
        return None, *top[module]
    layer = LAYER.match(module)
    index, part = int(layer.group(1)), layer.group(2)
    if part in ("attn_norm", "mlp_norm"):
        return index, f"{'input_layernorm' if part == 'attn_norm' else 'pre_mlp_layernorm'}.{leaf}", "whole"
    if part in ("attention.out", "mlp.fc_out"):  # row-parallel: weight split by columns, bias whole
        return index, f"{LINEARS[part]}.{leaf}", "whole" if leaf == "bias" else "columns"
    return index, f"{LINEARS[part]}.{leaf}", "swiglu" if part == "mlp.fc_in" and swiglu else "rows"


def _whole(args: argparse.Namespace, key: str, where: str) -> int | None:
    """An arg that Megatron's argparse makes a whole number, or None where it is not recorded; any
    other value is refused naming it (a "16" failed in arithmetic with a traceback)."""
    value = getattr(args, key, None)
    if value is not None and (type(value) is not int or value < 1):
        raise refuse(f"{where}: args.{key}", value, "is not a positive whole number", "the checkpoint's args are "
                     "damaged: set it to the value its run trained with")
    return value


def _vocab_size(args: argparse.Namespace, where: str, given: int | None) -> int:
    """The tokenizer's vocabulary. Megatron pads it to a multiple of make_vocab_size_divisible_by x tp
    (GPT-2's 50,257 to 50,304) and often records only the padded size: imported as the vocabulary,
    the padding rows would become tokens no tokenizer has. Where the args cannot tell, say so.
    ``args.vocab_size`` is the ``--vocab-size`` of Megatron's NullTokenizer, whose end-of-document
    id is that number: its vocabulary has one token more."""
    recorded, padded = _whole(args, "vocab_size", where), _whole(args, "padded_vocab_size", where)
    null = recorded is not None and getattr(args, "tokenizer_type", None) == "NullTokenizer"
    if null:
        recorded += 1
    what = f"a NullTokenizer of args.vocab_size {recorded - 1} and its end-of-document, {recorded} tokens" if null \
        else f"args.vocab_size {recorded}"
    if recorded is not None and padded is not None and recorded > padded:
        raise UserError(f"{where}: records {what}, more than args.padded_vocab_size {padded}; the checkpoint's args "
                        "contradict themselves")
    if given is not None:
        if recorded is not None and given != recorded:
            raise UserError(f"--vocab-size: {given}, but {where} records {what}; leave the flag out")
        if padded is not None and given > padded:
            raise UserError(f"--vocab-size: {given} is more than the {padded} rows of {where} (args.padded_vocab_size)")
        return given
    if recorded is not None or padded is None:
        return recorded
    multiple = (_whole(args, "make_vocab_size_divisible_by", where) or 128) * (
        _whole(args, "tensor_model_parallel_size", where) or 1)
    if padded % multiple == 0:
        print(f"megazero convert: note: {where}: args record only padded_vocab_size ({padded}, a multiple of "
              f"{multiple}): every row is imported as a token; if the tokenizer has fewer (50,257 for GPT-2), give "
              "--vocab-size to leave the padding out", flush=True)
    return padded


def tanh_gelu(bias: bool, bias_gelu_fusion: bool) -> bool:
    """Whether megatron-core computes a GeLU MLP with the tanh approximation (megazero's ``gelu``): only
    in its fused bias-GeLU, which runs with linear biases and Megatron-LM's ``bias_gelu_fusion`` (on
    unless ``--no-bias-gelu-fusion``); elsewhere it is exact (erf, megazero's ``gelu_exact``).
    ``openai_gelu`` is not read by its transformer config."""
    return bias and bias_gelu_fusion


def rank_dir(t: int, p: int, pp: int) -> str:
    return f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"


def model_config(args: argparse.Namespace, where: str, vocab_size: int | None = None) -> ModelConfig:
    """Our model config from Megatron's args; refuses (naming the arg) what our GPT cannot compute.
    ``vocab_size`` (``--vocab-size``) is the tokenizer's, for args that record only the padded one."""
    get = lambda key, default=None: getattr(args, key, default)

    def flag(key: str, default: bool) -> bool:
        """A switch of Megatron's argparse (always a bool there): a "False" read by ``bool()`` would
        import a model with the wrong layers, so anything else is refused, naming the arg."""
        value = get(key, default)
        if not isinstance(value, bool):
            raise refuse(f"{where}: args.{key}", value, "is not true or false", "set it to the boolean the "
                         "checkpoint's run trained with")
        return value

    fix = "megazero's GPT has no counterpart; such a model cannot be imported"
    for key, ok in UNSUPPORTED_ARGS:
        if get(key, ok) != ok:
            raise refuse(f"{where}: args.{key}", get(key), "is not supported", fix)
    named = lambda key, default: value if isinstance(value := get(key, default), str) else None  # a list is no name
    position = {"learned_absolute": "learned", "rope": "rope"}.get(named("position_embedding_type", "learned_absolute"))
    # the rotary settings change nothing where positions are learned, and are recorded there too
    for key, ok in (("rotary_interleaved", (False,)), ("rotary_percent", (1.0,)), ("use_rope_scaling", (False,)),
                    ("no_rope_freq", (None,)), ("rotary_seq_len_interpolation_factor", (None, 1))):
        if position == "rope" and get(key, ok[0]) not in ok:  # the factor divides the positions
            raise refuse(f"{where}: args.{key}", get(key), "is not supported", fix)
    if position is None:
        raise refuse(f"{where}: args.position_embedding_type", get("position_embedding_type"), "is not supported", fix)
    norm = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}.get(named("normalization", "LayerNorm"))
    if norm is None:
        raise refuse(f"{where}: args.normalization", get("normalization"), "is not supported", fix)
    bias = flag("add_bias_linear", True)
    if flag("add_qkv_bias", bias) != bias:
        raise refuse(f"{where}: args.add_qkv_bias", get("add_qkv_bias"), "differs from args.add_bias_linear", fix)
    swiglu = flag("swiglu", False)
    activation = "swiglu" if swiglu else "gelu" if tanh_gelu(bias, flag("bias_gelu_fusion", True)) else "gelu_exact"
    for key in ("num_layers", "hidden_size", "num_attention_heads"):
        if get(key) is None:
            raise UserError(f"{where}: its args lack args.{key}; the checkpoint is incomplete")
    heads = get("num_attention_heads")
    groups = get("num_query_groups") if flag("group_query_attention", False) else None
    vocab = _vocab_size(args, where, vocab_size)
    if vocab is None:
        raise UserError(f"{where}: its args record neither args.vocab_size nor args.padded_vocab_size; give the "
                        "tokenizer's vocabulary with --vocab-size")
    length = (get("max_position_embeddings") if position == "learned" else None) or get("seq_length") \
        or get("max_position_embeddings")
    if length is None:
        raise UserError(f"{where}: its args lack args.seq_length and args.max_position_embeddings; the checkpoint "
                        "is incomplete")
    # Megatron-LM records the norms' epsilon as norm_epsilon (--norm-epsilon); older releases, and newer ones
    # that parse the flag into megatron-core's config field, as layernorm_epsilon. Both present must agree.
    both = (get("norm_epsilon"), get("layernorm_epsilon"))
    if None not in both and both[0] != both[1]:
        raise refuse(f"{where}: args.norm_epsilon", both[0], f"differs from args.layernorm_epsilon {both[1]!r}, "
                     "and each names the norms' epsilon in some Megatron release", "the checkpoint's args "
                     "contradict themselves: set both to the value its run trained with")
    values = dict(num_layers=get("num_layers"), hidden_size=get("hidden_size"), num_heads=heads,
                  num_kv_heads=None if groups in (None, heads) else groups, ffn_hidden_size=get("ffn_hidden_size"),
                  vocab_size=vocab, seq_length=length, rope_theta=get("rotary_base", 10000),
                  norm_eps=get("norm_epsilon", get("layernorm_epsilon", 1e-5)), dropout=get("hidden_dropout", 0.0),
                  attention_dropout=get("attention_dropout", 0.0))
    hints = field_types(ModelConfig)
    for field, key in ARG_NAMES.KEYS.items():  # a "16" would fail in arithmetic, not name its arg
        values[field] = coerce(values[field], hints[field], f"{where}: {key}", UserError)
    cfg = ModelConfig(preset="llama" if position == "rope" else "gpt2", position_embedding=position, norm=norm,
                      activation=activation, bias=bias,
                      tie_embeddings=not flag("untie_embeddings_and_output_weights", False), **values)
    cfg = validated(cfg, ARG_NAMES.KEYS, where)
    if get("kv_channels") not in (None, cfg.head_dim):
        raise refuse(f"{where}: args.kv_channels", get("kv_channels"), f"differs from args.hidden_size / "
                     f"args.num_attention_heads = {cfg.head_dim}", "megazero derives the head width from those two")
    return cfg


UNSUPPORTED_ARGS = (
    ("apply_residual_connection_post_layernorm", False), ("squared_relu", False), ("multi_latent_attention", False),
    ("num_experts", None), ("qk_layernorm", False), ("qk_l2_norm", False), ("apply_layernorm_1p", False),
    ("window_size", None), ("softmax_type", "vanilla"), ("softmax_scale", None), ("glu_linear_offset", 0.0),
    ("activation_func_clamp_value", None), ("quick_geglu", False), ("attention_output_gate", False),
    ("experimental_attention_variant", None), ("mtp_num_layers", None), ("is_hybrid_model", False),
    ("hybrid_override_pattern", None), ("heterogeneous_layers_config_path", None),
    ("heterogeneous_layers_config_encoded_json", None))
"""Megatron args that change what the model computes (sliding-window attention, another softmax or
scale, an offset or clamp in the gated MLP, gates, multi-token prediction, experts, hybrid or
heterogeneous layers), each with the value under which it changes nothing. A checkpoint trained
with another value is refused naming the arg: imported, its weights would load into a model that
computes something else (the logits of a sliding-window model moved by more than their size)."""

ARG_NAMES = SimpleNamespace(KEYS={
    "num_layers": "args.num_layers", "hidden_size": "args.hidden_size", "num_heads": "args.num_attention_heads",
    "num_kv_heads": "args.num_query_groups", "ffn_hidden_size": "args.ffn_hidden_size",
    "vocab_size": "args.vocab_size", "seq_length": "args.seq_length", "norm_eps": "args.norm_epsilon",
    "rope_theta": "args.rotary_base", "dropout": "args.hidden_dropout", "attention_dropout": "args.attention_dropout"})
"""Our model fields' Megatron args, for the messages of ``validated``."""
