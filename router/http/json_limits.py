"""Bounding what a JSON body becomes once parsed, before it is parsed (pure).

A body's bytes are bounded on the way in (``ingress.max_request_bytes``), but what they parse into is
not: 7 MB of ``{"type":"text","text":""},`` is 280,000 dicts and, validated, 280,000 pydantic models
(~200 MB on the ingress) before any limit on messages or parts is looked at. So the values are
counted first: every array element and object member but a container's first follows a ``,``, and
every container opens with ``[`` or ``{``, so ``commas + opening brackets + 1`` outside strings is
at least the number of elements and members (and at most about twice it).

Counting over the raw bytes (strings included) is a C-speed upper bound that already clears every
ordinary body (base64 media has no commas or brackets). A body over the bound by that count is
counted token by token (a string is one token), stopping as soon as the bound is passed: at most a
few tokens per value allowed, in constant memory; big bodies on a worker thread.
"""

from __future__ import annotations

import asyncio
import json
import re

from router.protocol.errors import bad_request

DEFAULT_MAX_JSON_VALUES = 16_384
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[,\[{]', re.S)  # a whole string, or , [ {
_QUOTE = ord('"')
_THREAD_BYTES = 1 << 20  # exact counts over bodies this big run off the event loop


def upper_bound_values(body: bytes | bytearray) -> int:
    return body.count(b",") + body.count(b"[") + body.count(b"{") + 1


def count_values(body: bytes | bytearray, stop_after: int | None = None) -> int:
    """``commas + opening brackets + 1`` outside strings: at least the number of elements and members.
    With ``stop_after``, counting stops once the count exceeds it."""
    n = 1
    for m in _TOKEN.finditer(body):
        if body[m.start()] != _QUOTE:
            n += 1
            if stop_after is not None and n > stop_after:
                break
    return n


async def check_json_values(body: bytes | bytearray, max_values: int) -> None:
    """A 400 naming the limit if ``body`` would parse into more than ``max_values`` JSON values."""
    if upper_bound_values(body) <= max_values:
        return
    if len(body) >= _THREAD_BYTES:
        n = await asyncio.to_thread(count_values, body, max_values)
    else:
        n = count_values(body, max_values)
    if n > max_values:
        field = _top_level_field_at(body, max_values)
        where = f"{field}: " if field else ""
        raise bad_request(
            f"{where}request body has more than {max_values} JSON values (array elements and object "
            "members; ingress.max_json_values)",
            code="request_too_complex",
            param=field,
        )


_SCAN = re.compile(
    rb'"[^"\\]*(?:\\.[^"\\]*)*"\s*:?|[,\[{\]}]', re.S
)  # a string (a key if ":" follows), or , [ { ] }


def _top_level_field_at(body: bytes | bytearray, max_values: int) -> str | None:
    """The top-level member whose value holds the value that passes ``max_values`` (the request
    field to name in the 400, e.g. ``response_format`` for a 10,000-property schema), or None."""
    n, depth, key = 1, 0, None
    for m in _SCAN.finditer(body):
        tok = m.group()
        if tok[0] == _QUOTE:
            if depth == 1 and tok.endswith(b":"):
                key = tok[: tok.rindex(b'"') + 1]
            continue
        if tok in (b"]", b"}"):
            depth -= 1
            continue
        n += 1
        if tok in (b"[", b"{"):
            depth += 1
        if n > max_values:
            break
    if key is None:
        return None
    try:
        name = json.loads(key)
    except ValueError:
        return None
    return name if isinstance(name, str) and len(name) <= 64 else None
