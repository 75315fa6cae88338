"""cluster.bench.api_vs_peer's pure parts (and api_senders'): the call check, content kinds, the table."""

from __future__ import annotations

import json

from cluster.bench import api_vs_peer as avp
from cluster.bench.api_senders import check_call, content_kind


def test_check_call() -> None:
    assert check_call("get_weather", json.dumps({"city": "Paris"})) == "valid"
    assert check_call("get_weather", json.dumps({"city": "Rome"})).startswith("args invalid")
    assert check_call("nope", "{}") == "unknown name 'nope'"
    assert check_call("get_time", '{"tz": "UT') == "args not JSON"
    # vLLM 0.32's streamed `required` arguments: a bare digit run, which JSON reads as a number
    assert check_call("get_time", "63555555e815555") == "args not a JSON object (float)"


def test_content_kind() -> None:
    assert content_kind(None) == "none"
    assert content_kind("") == "none"
    assert content_kind("hi") == "text"
    assert content_kind('<tool_call>\n{"name"') == "text with <tool_call>"


def test_request_set_names_unique() -> None:
    names = [n for n, _, _ in avp.request_set()]
    assert len(names) == len(set(names)) == 19


def test_table_merges_by_name() -> None:
    ok = {
        "name": "r",
        "endpoint": "/v1/chat/completions",
        "status": 200,
        "finish_reason": "tool_calls",
        "content_kind": "none",
        "tool_calls": 1,
        "raw_calls": [["get_time", '{"tz": "UTC"}']],
        "prompt_tokens": 7,
    }
    bad = {"name": "r", "endpoint": "/v1/chat/completions", "status": 400, "error": "tools a|b"}
    t = avp.table({"a": [ok], "b": [bad]}).splitlines()
    assert t[0] == "| # | request | a | b |"
    assert "tool_calls: 1 (valid)" in t[2] and "prompt 7 tokens" in t[2]
    assert "**400** tools a\\|b" in t[2]
