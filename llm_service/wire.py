"""The versioned msgpack wire form of the LLM side's records (request specs in, outputs out).

Same convention as the encoder side's ``encoder_service/wire.py`` (the services share no code):
a record pickles as ``(decoder, (msgpack bytes, refs))`` so Ray still sees its ObjectRefs while the
contents are an explicit, versioned schema::

    wire record = {"v": WIRE_VERSION, "kind": "<record>", ...fields}
"""

from __future__ import annotations

from typing import Any

import msgpack

WIRE_VERSION = 1


class WireVersionError(ValueError):
    pass


def pack(kind: str, fields: dict[str, Any]) -> bytes:
    return bytes(msgpack.packb({"v": WIRE_VERSION, "kind": kind, **fields}, use_bin_type=True))


def unpack(kind: str, raw: bytes) -> dict[str, Any]:
    d = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    if not isinstance(d, dict) or d.get("kind") != kind:
        got = d.get("kind") if isinstance(d, dict) else type(d).__name__
        raise WireVersionError(f"expected a record of kind {kind!r}, got {got!r}")
    if d.get("v") != WIRE_VERSION:
        raise WireVersionError(
            f"{kind} wire version {d.get('v')!r} is not supported (this build reads {WIRE_VERSION})"
        )
    return dict(d)
