"""Typed reads of a parsed HF ``config.json``: its values are ``object`` until a read names their type.

``to_int`` / ``to_float`` convert as ``int()`` / ``float()`` do (and raise ``TypeError`` on a value
neither takes, as those do); ``number`` keeps a number as it is. A config reads as it did untyped.
"""

from __future__ import annotations

from collections.abc import Mapping

ConfigDict = dict[str, object]  # one JSON object of config.json: string keys, values of unknown shape


def section(d: Mapping[str, object], key: str) -> ConfigDict:
    """The nested object ``d[key]`` (the dict itself, not a copy); ``{}`` when absent, null or empty."""
    v = d.get(key)
    if not v:
        return {}
    if not isinstance(v, dict):
        raise TypeError(f"config.json: {key} must be an object, not {v!r}")
    return v


def to_int(v: object) -> int:
    """``int(v)`` of a JSON number (or numeric string)."""
    if isinstance(v, (int, float, str)):
        return int(v)
    raise TypeError(f"config.json: expected a number, not {v!r}")


def to_float(v: object) -> float:
    """``float(v)`` of a JSON number (or numeric string)."""
    if isinstance(v, (int, float, str)):
        return float(v)
    raise TypeError(f"config.json: expected a number, not {v!r}")


def number(v: object) -> float:
    """A JSON number as it is (an int stays an int, as a ``float`` field may hold)."""
    if isinstance(v, (int, float)):
        return v
    raise TypeError(f"config.json: expected a number, not {v!r}")


def opt_number(v: object) -> float | None:
    return None if v is None else number(v)


def to_list(v: object) -> list[object]:
    """A JSON array (or a tuple: a default spelled in code)."""
    if isinstance(v, (list, tuple)):
        return list(v)
    raise TypeError(f"config.json: expected an array, not {v!r}")
