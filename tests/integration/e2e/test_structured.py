"""Structured outputs and the sampling surface over HTTP with the real ``openai`` client, on the tiny
Qwen2-VL (random weights: only the grammar makes an output valid): the 20-schema suite streamed and
not, regex, choice and json_object; bad constraints and parameters are 400s naming their field,
answered within a second while normal requests go on beside them."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from cluster.bench.structured_suite import run_suite
from tests.integration.e2e.common import PORT, VL

BASE = f"http://127.0.0.1:{PORT}/v1"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_twenty_schemas_and_the_other_kinds_all_validate(app, stream) -> None:
    results = run_suite(BASE, VL, stream=stream, max_tokens=256, timeout=120)
    # json_object bounds no string: a random-weight model that opens one rarely closes it, so an
    # answer cut by max_tokens is the honest outcome there (finish_reason says so)
    bad = [
        (r.case, r.why)
        for r in results
        if not r.ok and not (r.kind == "json_object" and r.finish_reason == "length")
    ]
    assert not bad, bad
    assert len([r for r in results if r.kind == "json_schema"]) == 20
    assert all(r.whitespace <= 0 for r in results if r.kind == "json_schema"), "compact JSON only"


def _post(body: dict[str, Any]) -> httpx.Response:
    base = {"model": VL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    return httpx.post(f"{BASE}/chat/completions", json={**base, **body}, timeout=60)


BAD = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            }
        },
        "response_format",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
                },
            }
        },
        "response_format",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {
                        "type": "object",
                        "properties": {f"p{i}": {"type": "integer"} for i in range(2_000)},
                    },
                },
            }
        },
        "response_format",
    ),
    (  # 10,000 properties pass ingress.max_json_values (16384) first: refused before parsing, named
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {
                        "type": "object",
                        "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)},
                    },
                },
            }
        },
        "response_format",
    ),
    ({"structured_outputs": {"regex": "[^\\x00-\\U0010FFFF]"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs"),
    ({"n": 10_000}, "n"),
    ({"logit_bias": {str(i): 1 for i in range(1000)}}, "logit_bias"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),
    ({"stop_token_ids": [10**8]}, "stop_token_ids"),
    ({"min_tokens": 20, "max_tokens": 8}, None),  # a model-level check: the message names both
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"frobnicate": True}, "frobnicate"),
]


def test_bad_constraints_and_parameters_are_400s_naming_the_field_beside_a_normal_load(app) -> None:
    done: list[int] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            done.append(_post({"max_tokens": 16}).status_code)

    workers = [threading.Thread(target=load) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        for body, field in BAD:
            t = time.monotonic()
            r = _post(body)
            took = time.monotonic() - t
            assert r.status_code == 400, (body.keys(), r.text)
            err = r.json()["error"]
            named = field or "min_tokens"
            assert named in err["message"], err
            assert field is None or err["param"] == field, err
            assert took < 1.0, (named, took)
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert done and set(done) == {200}


def test_sampling_parameters_reach_the_engine(app) -> None:
    r = _post(
        {
            "max_tokens": 12,
            "min_tokens": 12,
            "temperature": 0.8,
            "seed": 3,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.5,
            "repetition_penalty": 1.2,
            "min_p": 0.05,
            "logit_bias": {"5": 2.0},
            "stop_token_ids": [7],
            "user": "someone",
            "metadata": {"k": "v"},
        }
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 12  # min_tokens held the stop tokens back
    again = _post(json.loads(r.request.content))
    assert again.json()["choices"][0]["message"]["content"] == r.json()["choices"][0]["message"]["content"]


def test_ended_by_max_tokens_inside_the_json_says_length(app) -> None:
    """A required key longer than 4 tokens: the object cannot close within them, whatever is sampled
    (a ``json_object`` could, as ``{}``, and then it says ``stop``)."""
    key = "a_property_name_longer_than_four_tokens"
    schema = {"type": "object", "properties": {key: {"type": "integer"}}, "required": [key]}
    fmt = {"type": "json_schema", "json_schema": {"name": "cut", "schema": schema}}
    for temperature in (0.0, 1.0):
        r = _post({"max_tokens": 4, "temperature": temperature, "response_format": fmt})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith('{"a_')
