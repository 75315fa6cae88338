"""JSON the benchmarks read but do not define (``/stats`` bodies, ``serve status``, result files):
``object`` until a read narrows it, as ``int()`` and attribute access would have failed on it."""

from __future__ import annotations

JSON = dict[str, object]  # one parsed JSON object: string keys, values of unknown shape


def json_object(v: object) -> JSON:
    """``v``, which must be a JSON object (the dict itself, not a copy)."""
    if not isinstance(v, dict):
        raise TypeError(f"expected a JSON object, not {v!r}")
    return v


def json_int(v: object) -> int:
    """``int(v)`` of a JSON number (or numeric string)."""
    if isinstance(v, (int, float, str)):
        return int(v)
    raise TypeError(f"expected a number, not {v!r}")


def json_float(v: object) -> float:
    """``float(v)`` of a JSON number (or numeric string)."""
    if isinstance(v, (int, float, str)):
        return float(v)
    raise TypeError(f"expected a number, not {v!r}")
