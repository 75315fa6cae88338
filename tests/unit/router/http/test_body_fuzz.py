"""Property-based fuzzing of the request body on the ingress's own path (``ChatService.read_request``
from raw bytes, then ``normalize_messages``): random bytes, mutations of a valid body (bytes flipped,
cut, duplicated, spliced), and random JSON values. Every outcome is a parsed request or the project's
own ``APIError`` with a 4xx status; never another exception."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.bench.fuzz.asgi import request
from router.http.chat import ChatService
from router.protocol.errors import APIError
from router.protocol.messages import MessageLimits, normalize_messages

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 32).decode()
VALID = json.dumps(
    {
        "model": "m",
        "max_tokens": 8,
        "temperature": 0.5,
        "stream": True,
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}, "uuid": "a"},
                    {"type": "input_audio", "input_audio": {"data": PNG, "format": "wav"}},
                ],
            },
        ],
    }
).encode()
LIMITS = MessageLimits(
    max_messages=16,
    max_content_parts=16,
    max_media_bytes=1 << 20,
    limit_mm_per_prompt={"image": 2, "audio": 1},
)
SERVICE = ChatService({}, max_request_bytes=1 << 16, max_json_values=512)


def _check(body: bytes) -> None:
    async def run() -> None:
        req = await SERVICE.read_request(request(body, "/v1/chat/completions"))
        normalize_messages(req.messages, LIMITS, tenant=None)

    try:
        asyncio.run(run())
    except APIError as e:
        assert 400 <= e.status_code < 500, (e.status_code, e.message)


def _mutate(data: st.DataObject) -> bytes:
    body = bytearray(VALID)
    for _ in range(data.draw(st.integers(1, 6))):
        op = data.draw(st.sampled_from(["flip", "cut", "dup", "insert", "delete"]))
        i = data.draw(st.integers(0, max(0, len(body) - 1)))
        if op == "flip" and body:
            body[i] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del body[i:]
        elif op == "dup":
            body[i:i] = body[i : i + data.draw(st.integers(1, 64))]
        elif op == "insert":
            body[i:i] = data.draw(
                st.sampled_from([b"[", b"{", b'"', b"\\", b"1e999", b"null", b"-", b"\xff"])
            )
        elif body:
            del body[i : i + data.draw(st.integers(1, 16))]
    return bytes(body)


def test_the_valid_body_parses() -> None:
    _check(VALID)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_bodies_are_parsed_or_4xx(data: st.DataObject) -> None:
    _check(_mutate(data))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_are_4xx(body: bytes) -> None:
    _check(body)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {"model": json_values, "messages": json_values},
        optional={
            "max_tokens": json_values,
            "stream": json_values,
            "temperature": json_values,
            "n": json_values,
        },
    )
)
def test_random_json_shapes_are_parsed_or_4xx(payload: dict[str, Any]) -> None:
    _check(json.dumps(payload).encode())
