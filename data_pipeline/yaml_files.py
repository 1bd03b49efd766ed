"""Reading a YAML file whose top level is a mapping: the training config, the curation config and
blend presets all go through here (it sits in ``data_pipeline``, below ``megazero``, so both can).

Plain YAML keeps the last of two equal keys in one mapping, so a config that repeats a section
(``train:`` twice, say) silently loses the first section's fields, and a repeated field its earlier
value. Here a repeated key is an error naming its line and the line it first appeared on.
"""

from __future__ import annotations

import os

import yaml


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key appearing twice in one mapping as written.

    The check runs when a mapping is flattened, before its merge keys (``<<: *anchor``) bring in the
    anchored mapping's keys, which its own keys may override: a mapping merged into another is
    flattened, and checked, first, and only once."""

    def flatten_mapping(self, node):
        checked = self.__dict__.setdefault("_checked", set())
        if id(node) not in checked:
            checked.add(id(node))
            first_line: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
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


def read_yaml_mapping(path: str, what: str, error: type[Exception] = ValueError) -> dict:
    """The mapping in YAML file ``path`` ({} when empty); ``what`` names what the top level must hold
    in the message when it is not a mapping. Every problem is one ``error`` naming the file (and
    line, where YAML knows it)."""
    if not os.path.isfile(path):
        raise error(f"{path}: file not found")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.load(f, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except UnicodeDecodeError:
        raise error(f"{path}: not a text file (not UTF-8)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise error(f"{path}{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise error(f"{path}: the top level must be a mapping ({what})")
    return raw
