"""Building a ``Config`` from YAML and dotted command-line overrides, and writing it back.

Types are checked against the dataclass annotations as the values arrive, so a string where an
integer goes or a misspelled key fails here, with the dotted field name, before anything runs.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
import typing
from typing import Any, Iterable

import yaml

from data_pipeline import typed_config
from data_pipeline.yaml_files import AmbiguousNumber, read_yaml_mapping, read_yaml_value
from models.presets import MODEL_PRESETS
from megazero.config.schema import Config
from megazero.errors import ConfigError


def load_config(path: str | None = None, overrides: Iterable[str] = ()) -> Config:
    """Read ``path`` (YAML; optional) and apply ``--section.field value`` overrides."""
    raw: dict = {}
    if path is not None:
        raw = read_yaml(path)
    for key, value in parse_overrides(list(overrides), Config):
        set_dotted(raw, key, value)
    _apply_model_preset(raw)
    _resolve_auto_vocab(raw)
    return build_dataclass(Config, raw, prefix="")


def read_yaml(path: str, schema: type = Config) -> dict:
    """The sections of config file ``path``, the unquoted values of ``schema``'s text fields as written."""
    if os.path.isdir(path):  # a run directory, say, whose resolved config.yaml is the file meant
        inside = os.path.join(path, "config.yaml")
        such = f", such as {inside}" if os.path.isfile(inside) else ""
        raise ConfigError(f"{path}: is a folder, not a config file; give a YAML file{such}")
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    return read_yaml_mapping(path, "of sections: model:, parallel:, ...", ConfigError, _text_fields(schema))


def parse_overrides(args: list[str], schema: type | None = None) -> list[tuple[str, Any]]:
    """``['--parallel.tp', '2', '--train.seed=3']`` -> ``[('parallel.tp', 2), ('train.seed', 3)]``.

    Values are parsed as YAML scalars so ``true``, ``3``, ``[4, 4]`` and ``null`` keep their types;
    a value for a text field of ``schema`` is taken as typed (``null`` aside, for an optional one, and
    a quoted YAML string read as YAML reads it), since YAML would read ``2024_01`` as 202401,
    ``98:1:1`` as a base-60 number and cut ``runs/exp #3`` at its comment. A field given twice takes
    its last value, so a script's defaults can be overridden.
    """
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.field VALUE")
        key = arg[2:]
        if "=" in key:
            key, text = key.split("=", 1)
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{key} has no value: write --{key} VALUE")
            i += 1
            text = args[i]
        text_field, optional = _text_field(schema, key.replace("-", "_"))
        quoted = len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""
        if text_field and not quoted:
            value = None if optional and text in ("null", "~") else text
        else:
            try:
                value = read_yaml_value(text)
            except AmbiguousNumber as exc:
                raise ConfigError(f"--{key}: {exc.problem}") from None
            except yaml.YAMLError:
                value = text
        pairs.append((key, value))
        i += 1
    return pairs


def _text_field(schema: type | None, key: str) -> tuple[bool, bool]:
    """(whether dotted ``key`` names a ``str`` field of dataclass ``schema``, whether it may be None)."""
    node: Any = schema
    for name in key.split("."):
        hints = typed_config.field_types(node) if dataclasses.is_dataclass(node) else {}
        if name not in hints:
            return False, False
        node = hints[name]
    union = typing.get_origin(node) in (typing.Union, types.UnionType)  # Optional[str] or str | None
    options = set(typing.get_args(node)) if union else {node}
    return options - {type(None)} == {str}, type(None) in options


@functools.lru_cache(maxsize=None)
def _text_fields(schema: type) -> frozenset:
    """The ``(section, field)`` pairs of ``schema``'s text fields, whose unquoted values a YAML file
    gives as written, as the command line does."""
    return frozenset(tuple(name.split(".")) for name, _, _ in field_docs(schema) if _text_field(schema, name)[0])


def set_dotted(raw: dict, key: str, value: Any) -> None:
    section, _, name = key.partition(".")
    if not name or "." in name:
        raise ConfigError(f"override --{key}: expected --section.field (e.g. --parallel.tp)")
    if raw.get(section) is None:  # absent, or a YAML section left empty (``data:``), as the file reads it
        raw[section] = {}
    node = raw[section]
    if not isinstance(node, dict):
        raise ConfigError(f"{section}: expected a mapping of fields, got {type(node).__name__}")
    node[name] = value


def _apply_model_preset(raw: dict) -> None:
    model = raw.get("model")
    if not isinstance(model, dict) or model.get("preset") is None:
        return
    name = model["preset"]
    if not isinstance(name, str) or name not in MODEL_PRESETS:
        raise ConfigError(f"model.preset: unknown preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
    raw["model"] = {**MODEL_PRESETS[name], **model}


def _resolve_auto_vocab(raw: dict) -> None:
    """``model.vocab_size: auto`` takes the size of ``data.tokenizer``'s vocabulary."""
    model = raw.get("model")
    if not isinstance(model, dict) or model.get("vocab_size") != "auto":
        return
    data = raw.get("data")
    path = data.get("tokenizer") if isinstance(data, dict) else None
    if path is not None and not isinstance(path, str):
        raise ConfigError(f"data.tokenizer: expected a path, got {path!r}")
    if not path:
        raise ConfigError("model.vocab_size: auto needs data.tokenizer (the tokenizer whose vocabulary the model "
                          "gets); give data.tokenizer or a number")
    from data_pipeline.tokenizer import load_tokenizer

    try:
        model["vocab_size"] = load_tokenizer(path).vocab_size
    except (ValueError, OSError) as exc:
        raise ConfigError(f"data.tokenizer: {exc}") from None


def build_dataclass(cls: type, raw: Any, prefix: str) -> Any:
    """Instantiate ``cls`` from a mapping, checking keys and types (``ConfigError`` names the field)."""
    return typed_config.build_dataclass(cls, raw, prefix, error=ConfigError)


def known_fields(cls: type, raw: Any) -> tuple[Any, list[str]]:
    """``raw`` without the keys ``cls`` has no field for (in every section), and those keys, dotted:
    a checkpoint's record of its config, written by a version with a field this one has since
    dropped, read for what this version knows of it."""
    if not (dataclasses.is_dataclass(cls) and isinstance(raw, dict)):
        return raw, []
    hints = typed_config.field_types(cls)
    kept, dropped = {}, []
    for key, value in raw.items():
        if key not in hints:
            dropped.append(str(key))
            continue
        kept[key], inner = known_fields(hints[key], value)
        dropped += [f"{key}.{name}" for name in inner]
    return kept, dropped


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str) -> None:
    """Write the resolved config atomically, so a crashed start never leaves half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False)
    os.replace(tmp, path)


def field_docs(cls: type = Config, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted name, default, help) for every leaf field, in declaration order."""
    rows = []
    for f in dataclasses.fields(cls):
        hint = typed_config.field_types(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            rows.extend(field_docs(hint, f"{prefix}{f.name}."))
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append((f"{prefix}{f.name}", default, f.metadata.get("help", "")))
    return rows
