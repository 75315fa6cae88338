"""The parsed size of a request body is bounded before it is parsed (router/http/json_limits.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import tracemalloc

import pytest

from cluster.bench.fuzz.asgi import request
from router.http.chat import ChatService
from router.http.json_limits import check_json_values, count_values
from router.protocol.errors import APIError


@pytest.mark.parametrize(
    ("doc", "n"),
    [
        ({}, 2),  # "{" + 1
        ({"a": 1, "b": [1, 2, 3]}, 6),  # 3 commas + 2 brackets + 1
        ({"s": 'a,b,[c]{d}\\",', "t": ["x,y"]}, 4),  # commas and brackets inside strings do not count
        ([[], [[]], {}], 8),
    ],
)
def test_count_values_is_exact_outside_strings(doc: object, n: int) -> None:
    assert count_values(json.dumps(doc).encode()) == n


def test_a_body_of_many_small_parts_is_refused_before_it_is_parsed() -> None:
    parts = [{"type": "text", "text": ""}] * 280_000  # ~7 MB
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": parts}]}).encode()
    service = ChatService({}, 64 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(APIError) as e:
            asyncio.run(service.read_request(request(body, "/")))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.value.status_code == 400 and e.value.code == "request_too_complex"
    assert "max_json_values" in e.value.message
    assert peak < 3 * len(body), f"peak {peak / 1e6:.1f} MB for a {len(body) / 1e6:.1f} MB body"


def test_ordinary_bodies_pass() -> None:
    image = "data:image/png;base64," + base64.b64encode(bytes(1_000_000)).decode()
    prose = "Hello, world; [a], {b}, " * 20_000  # commas in text only: counted exactly, then let through
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}] * 2
    messages += [{"role": "user", "content": prose}]
    body = json.dumps({"model": "m", "messages": messages, "stop": ["a", "b"]}).encode()
    asyncio.run(check_json_values(body, 256))
    req = asyncio.run(ChatService({}, 64 << 20).read_request(request(body, "/")))
    assert len(req.messages) == 3


@pytest.mark.parametrize("field", ["response_format", "structured_outputs", "messages"])
def test_a_body_over_the_bound_is_refused_naming_the_top_level_field_that_holds_it(field: str) -> None:
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}}
    body = json.dumps({"model": "m", "max_tokens": 4, field: [big], "stream": False}).encode()
    with pytest.raises(APIError) as e:
        asyncio.run(check_json_values(body, 16_384))
    assert e.value.param == field and e.value.message.startswith(f"{field}: ")
    assert e.value.code == "request_too_complex"
