"""Reading a YAML file whose top level is a mapping: the training config, the curation config and
blend presets all go through here (it sits in ``data_pipeline``, below ``megazero``, so both can).

Plain YAML keeps the last of two equal keys in one mapping, so a config that repeats a section
(``train:`` twice, say) silently loses the first section's fields, and a repeated field its earlier
value. Here a repeated key is an error naming its line and the line it first appeared on. And
YAML 1.1 reads some text as numbers (``98:1:1``, ``2024_01``): a caller may name the text fields
whose unquoted values are read as written; an unquoted number of any other field that YAML 1.1
reads as something else than it looks (``0042`` as octal 34, ``1:30`` as 90) is refused.
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional

import yaml

_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_READ_AS_TEXT = (_INT, _FLOAT, "tag:yaml.org,2002:bool")
_LEADING_ZERO = re.compile(r"[-+]?0[0-9_]+")
_BASE_60 = re.compile(r"[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?")


def ambiguous_number(text: str) -> Optional[str]:
    """Why the unquoted ``text`` does not read as the number it looks like, else None. YAML 1.1 reads
    a leading zero as octal (``0042`` is 34, ``010`` is 8) or, where a digit is 8 or 9, as text, and
    colons as base 60 (``1:30`` is 90): a seed or a step count would change without a word."""
    if _LEADING_ZERO.fullmatch(text):
        return f"{text} has a leading zero, which YAML 1.1 reads as octal (or as text); write the number without it"
    if _BASE_60.fullmatch(text):
        return f"{text} is a base-60 number to YAML 1.1; write the number itself (or quote it for text)"
    return None


class AmbiguousNumber(yaml.constructor.ConstructorError):
    """An unquoted number YAML 1.1 reads as another value than it looks (``ambiguous_number``)."""


def _plainly(construct):
    """``construct`` for a number tag, refusing an unquoted scalar that ``ambiguous_number`` names."""
    def checked(loader, node):
        problem = ambiguous_number(node.value) if node.style is None else None
        if problem:
            raise AmbiguousNumber(None, None, problem, node.start_mark)
        return construct(loader, node)
    return checked
_MERGE = "tag:yaml.org,2002:merge"


def _pairs(node, seen: frozenset = frozenset()) -> list:
    """The (key, value) nodes of a mapping node, with those its merge keys bring in (a mapping merged
    into itself once); none for any other node."""
    if not isinstance(node, yaml.MappingNode) or id(node) in seen:
        return []
    pairs = []
    for key, value in node.value:
        if key.tag == _MERGE:
            for merged in value.value if isinstance(value, yaml.SequenceNode) else [value]:
                pairs += _pairs(merged, seen | {id(node)})
        else:
            pairs.append((key, value))
    return pairs


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key appearing twice in one mapping as written, and reads the
    unquoted values of ``text_fields`` (``(section, field)`` pairs) as written.

    The check runs when a mapping is flattened, before its merge keys (``<<: *anchor``) bring in the
    anchored mapping's keys, which its own keys may override: a mapping merged into another is
    flattened, and checked, first, and only once."""

    def __init__(self, stream, text_fields: frozenset = frozenset()):
        super().__init__(stream)
        self.text_fields = text_fields

    def construct_document(self, node):
        """YAML 1.1 reads ``98:1:1`` as a base-60 number, ``2024_01`` as 202401 and ``no`` as false,
        where the command line takes a text field's value as typed: an unquoted number or boolean
        given to a text field (directly or through a merge key) is read as its text."""
        for section, fields in _pairs(node):
            for key, value in _pairs(fields) if isinstance(section, yaml.ScalarNode) else ():
                if (isinstance(key, yaml.ScalarNode) and (section.value, key.value) in self.text_fields
                        and isinstance(value, yaml.ScalarNode) and value.style is None and value.tag in _READ_AS_TEXT):
                    value.tag = "tag:yaml.org,2002:str"
        return super().construct_document(node)

    def flatten_mapping(self, node):
        checked = self.__dict__.setdefault("_checked", set())
        if id(node) not in checked:
            checked.add(id(node))
            first_line: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    earlier = first_line.get(key)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if earlier is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} appears twice (first on line {earlier}); keep one",
                        key_node.start_mark)
                first_line[key] = key_node.start_mark.line + 1
        super().flatten_mapping(node)


_UniqueKeyLoader.add_constructor(_INT, _plainly(yaml.SafeLoader.construct_yaml_int))
_UniqueKeyLoader.add_constructor(_FLOAT, _plainly(yaml.SafeLoader.construct_yaml_float))


def read_yaml_value(text: str) -> Any:
    """One value written on a command line (``--train.seed 42``), read as a config file's would be:
    an ``AmbiguousNumber`` where the file's reader refuses one too."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader


def read_yaml_mapping(path: str, what: str, error: type[Exception] = ValueError,
                      text_fields: frozenset = frozenset()) -> dict:
    """The mapping in YAML file ``path`` ({} when empty); ``what`` names what the top level must hold
    in the message when it is not a mapping. Every problem is one ``error`` naming the file (and
    line, where YAML knows it). An unquoted number given to one of ``text_fields`` (``(section,
    field)`` pairs) is read as written."""
    if not os.path.isfile(path):
        raise error(f"{path}: file not found")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.load(f, Loader=lambda stream: _UniqueKeyLoader(stream, text_fields))  # noqa: S506 - a SafeLoader
    except UnicodeDecodeError:
        raise error(f"{path}: not a text file (not UTF-8)") from None
    except AmbiguousNumber as exc:
        mark = exc.problem_mark
        raise error(f"{path} (line {mark.line + 1}, column {mark.column + 1}): {exc.problem}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise error(f"{path}{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise error(f"{path}: the top level must be a mapping ({what})")
    return raw
