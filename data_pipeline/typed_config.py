"""Typed dataclass configs from YAML mappings: the one builder the training config and the curation
config share (it sits here, below both, because ``data_pipeline`` may not import ``megazero``).

Values are checked against the dataclass annotations as they arrive, converting only where nothing
is lost (an integral float to int, YAML 1.1's strings ``3e-4`` to float and ``3e11`` to int, a
number to a string, one string to a one-item list; a number in quotes is text, which a number
field refuses), so a wrong type or a misspelled key fails with its dotted field name before
anything runs. The caller picks the exception type its users see.
"""

from __future__ import annotations

import dataclasses
import decimal
import difflib
import functools
import re
import reprlib
import types
import typing
from typing import Any

from data_pipeline.yaml_files import ambiguous_number

_INT_DIGITS = 30  # more than any count a config holds; an integer spelled with an exponent is refused past it
# A float with an exponent, as YAML 1.2 reads one; YAML 1.1 leaves it text where it lacks a dot or
# the exponent's sign (3e-4, 1.0e5)
_EXPONENT_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+")


@functools.lru_cache(maxsize=None)
def field_types(cls: type) -> types.MappingProxyType:
    """``cls``'s resolved field annotations, by name. Resolving them evaluates every annotation string
    afresh (postponed annotations), which made reading one config cost about 0.1 s of a CPU; a
    dataclass's annotations do not change, so each class is resolved once (read-only, being shared)."""
    return types.MappingProxyType(typing.get_type_hints(cls))


def build_dataclass(cls: type, raw: Any, prefix: str = "", error: type[Exception] = ValueError) -> Any:
    """Instantiate ``cls`` from a mapping, checking keys and types; nested dataclasses recurse (a
    missing or null section takes its defaults)."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise error(f"{where}: expected a mapping of fields, got {type(raw).__name__} {shown(raw)}")
    hints = field_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            known = f"known fields: {', '.join(names)}" if names else f"{where} takes no fields"
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; {known}"
            raise error(f"{prefix}{key}: unknown key{hint}")
    values = {}
    for name in names:
        if name not in raw:
            continue
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = build_dataclass(hint, raw[name] if raw[name] is not None else {}, f"{prefix}{name}.", error)
        else:
            values[name] = coerce(raw[name], hint, f"{prefix}{name}", error)
    return cls(**values)


def coerce(value: Any, hint: Any, name: str, error: type[Exception] = ValueError, nullable: bool = False) -> Any:
    """Check ``value`` against a field annotation, converting only where it loses nothing. A field
    that may be null (``Optional``) says so when refused: null is its default more often than not."""
    if typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return None if value is None else coerce(value, args[0], name, error, nullable=True)

    def refused(what: str) -> Exception:
        what = what.replace(" or ", ", ") + " or null" if nullable else what
        return error(f"{name}: expected {what}, got {shown(value)}")

    if hint is bool:
        if isinstance(value, bool):
            return value
        raise refused("true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and (problem := ambiguous_number(value)):  # 08: YAML 1.1 left it text
            raise error(f"{name}: {problem}")
        if isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value):  # a token budget of 3e11
            exact = decimal.Decimal(value)
            # bounded before it is spelled out: 1e10000000 took minutes to turn into an int
            if exact.adjusted() <= _INT_DIGITS and exact == exact.to_integral_value():
                return int(exact)
        raise refused("an integer")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an integer of hundreds of digits
                raise refused("a number within a float's range") from None
        if isinstance(value, str) and _number_yaml_left_as_text(value):
            return float(value)
        raise refused("a number")
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # --data.split 1
            return str(value)
        raise refused("a string")
    if typing.get_origin(hint) is list:  # list[T]: a list, each item a T
        (item,) = typing.get_args(hint)
        return [coerce(v, item, f"{name}[{k}]", error)
                for k, v in enumerate(coerce(value, list, name, error, nullable))]
    if hint is list:
        if isinstance(value, (list, tuple)):
            return list(value)
        if isinstance(value, str):  # one path where a list of paths goes
            return [value]
        raise refused("a list")
    if hint is dict:
        if value is None or isinstance(value, dict):
            return dict(value or {})
        raise refused("a mapping")
    return value


SHOWN_CHARS = 200


def shown(value: Any) -> str:
    """A refused value as an error line shows it, cut to about ``SHOWN_CHARS``: a YAML alias tree of a
    few hundred bytes spells out to gigabytes, which the one-line error printed whole (after
    building it in memory)."""
    if _size_within(value, SHOWN_CHARS) is not None:
        return repr(value)
    limited = reprlib.Repr()
    limited.maxlevel, limited.maxlist, limited.maxdict = 3, 4, 4
    limited.maxstring = limited.maxother = limited.maxlong = SHOWN_CHARS // 4
    return f"{limited.repr(value)[:SHOWN_CHARS]} (cut)"


def _size_within(value: Any, budget: int) -> int | None:
    """What is left of ``budget`` after ``value``'s items and characters, None once it runs out
    (without walking the rest: the tree may be too large to walk)."""
    if isinstance(value, (list, tuple, set, dict)):
        for item in (value.items() if isinstance(value, dict) else value):
            budget -= 1
            if budget < 0 or (budget := _size_within(item, budget)) is None:
                return None
        return budget
    if isinstance(value, (str, bytes)):
        budget -= len(value)
    else:  # an integer's digits, or a float's or a date's few characters
        budget -= value.bit_length() // 3 + 1 if isinstance(value, int) else 8
    return budget if budget >= 0 else None


def _number_yaml_left_as_text(text: str) -> bool:
    """Whether a float field's string is a number YAML 1.1 read as text: an exponent's float, or
    nan/inf (left for the field's own check to refuse by name). Any other string is text a number
    field does not take: a number written in quotes (``"1"``) was meant as text, and Python's
    ``float`` would also take ``" 1 "`` and ``"1_0"`` (10.0)."""
    return bool(_EXPONENT_FLOAT.fullmatch(text)) or text.lower().lstrip("+-") in ("nan", "inf", "infinity")
