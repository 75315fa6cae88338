"""One request per endpoint of the OpenAI API through the real ``openai`` client, each summarized into a
row of plain values (``api_vs_peer.py`` sends them): chat completions (plain and streamed: tool calls
gathered from the deltas), completions, responses (plain and streamed: the event types in order);
the tools they offer and ``check_call``, which validates a call's arguments with ``jsonschema``."""

from __future__ import annotations

import base64
import json
from typing import Any

import jsonschema
import openai

from cluster.bench.media import make_image_bytes

WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}
TIME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}


def tool(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "description": f"{name} tool", "parameters": schema},
    }


TOOLS = [tool("get_weather", WEATHER_SCHEMA), tool("get_time", TIME_SCHEMA)]
RESP_TOOLS = [
    {"type": "function", "name": n, "description": f"{n} tool", "parameters": s} for n, s in SCHEMAS.items()
]


def image_data_url(seed: int = 0) -> str:
    return "data:image/png;base64," + base64.b64encode(make_image_bytes(64, 48, seed=seed)).decode()


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def history(tool_content: Any) -> list[dict[str, Any]]:
    """User asks, the assistant called get_weather, the tool answered with ``tool_content``."""
    return [
        user("What is the weather in Paris?"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": tool_content},
    ]


def content_kind(text: str | None) -> str:
    if not text:
        return "none"
    if "<tool_call>" in text:
        return "text with <tool_call>"
    return "text"


def check_call(name: str | None, arguments: str | None) -> str:
    """'valid' when ``name`` is a known tool and ``arguments`` parse and validate, else why not."""
    if name not in SCHEMAS:
        return f"unknown name {name!r}"
    try:
        args = json.loads(arguments or "")
    except ValueError:
        return "args not JSON"
    if not isinstance(args, dict):
        return f"args not a JSON object ({type(args).__name__})"
    try:
        jsonschema.validate(args, SCHEMAS[name])
    except jsonschema.ValidationError as e:
        return f"args invalid: {e.message[:60]}"
    return "valid"


def calls_summary(calls: list[tuple[str | None, str | None]]) -> dict[str, Any]:
    return {
        "tool_calls": len(calls),
        "calls": [f"{n}: {check_call(n, a)}" for n, a in calls],
        "all_valid": bool(calls) and all(check_call(n, a) == "valid" for n, a in calls),
        "raw_calls": [[n, a] for n, a in calls],
    }


def short(text: str | None, n: int = 80) -> str:
    return "" if text is None else (text[:n] + ("…" if len(text) > n else ""))


# ---------------------------------------------------------------------------------------------------
# Chat completions


def chat(client: openai.OpenAI, model: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    r = client.chat.completions.create(model=model, max_tokens=max_tokens, temperature=0, **kw)
    ch = r.choices[0]
    calls = [
        (c.function.name, c.function.arguments) for c in (ch.message.tool_calls or []) if c.type == "function"
    ]
    return {
        **calls_summary(calls),
        "finish_reason": ch.finish_reason,
        "content_kind": content_kind(ch.message.content),
        "content": short(ch.message.content),
        "prompt_tokens": r.usage.prompt_tokens if r.usage else None,
    }


def chat_stream(client: openai.OpenAI, model: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    stream = client.chat.completions.create(
        model=model,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    )
    text, finish, calls, chunks = "", None, dict[int, list[Any]](), 0
    prompt_tokens: int | None = None
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        text += c.delta.content or ""
        for tc in c.delta.tool_calls or []:
            slot = calls.setdefault(tc.index, [None, ""])
            if tc.function and tc.function.name:
                slot[0] = tc.function.name
            if tc.function and tc.function.arguments:
                slot[1] += tc.function.arguments
        finish = c.finish_reason or finish
    return {
        **calls_summary([(n, a) for n, a in (calls[i] for i in sorted(calls))]),
        "finish_reason": finish,
        "content_kind": content_kind(text),
        "content": short(text),
        "chunks": chunks,
        "prompt_tokens": prompt_tokens,
    }


# ---------------------------------------------------------------------------------------------------
# Completions and responses


def completion(client: openai.OpenAI, model: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    r = client.completions.create(model=model, max_tokens=max_tokens, temperature=0, **kw)
    ch = r.choices[0]
    lp = ch.logprobs
    return {
        "finish_reason": ch.finish_reason,
        "content_kind": content_kind(ch.text),
        "content": short(ch.text),
        "logprobs_tokens": None if lp is None or lp.tokens is None else len(lp.tokens),
        "prompt_tokens": r.usage.prompt_tokens if r.usage else None,
    }


def response_out(resp: Any) -> dict[str, Any]:
    kinds = [o.type for o in resp.output]
    calls = [(o.name, o.arguments) for o in resp.output if o.type == "function_call"]
    text = resp.output_text
    return {
        **calls_summary(calls),
        "finish_reason": resp.status,
        "content_kind": "items: " + ",".join(kinds) + ("; " + content_kind(text) if text else ""),
        "content": short(text),
        "prompt_tokens": resp.usage.input_tokens if resp.usage else None,
    }


def responses(client: openai.OpenAI, model: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    return response_out(
        client.responses.create(model=model, max_output_tokens=max_tokens, temperature=0, **kw)
    )


def responses_stream(client: openai.OpenAI, model: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    events: list[str] = []
    final = None
    for ev in client.responses.create(
        model=model, max_output_tokens=max_tokens, temperature=0, stream=True, **kw
    ):
        if not events or events[-1] != ev.type:
            events.append(ev.type)
        if ev.type in ("response.completed", "response.incomplete", "response.failed"):
            final = ev.response
    out: dict[str, Any] = (
        response_out(final)
        if final is not None
        else {"finish_reason": None, "content_kind": "no final event"}
    )
    out["events"] = events
    return out
