"""The API surface, request by request, against any OpenAI-compatible server (issue 47): tools and
``tool_choice`` modes, tool messages with text and with an image, ``/v1/completions`` and
``/v1/responses`` (text, image, function tool, streamed), and bad inputs, each sent once through the
real ``openai`` client. One row per request: accepted (HTTP status), what came back (``tool_calls``
and whether their arguments validate against the tool's schema with ``jsonschema``, finish reason,
the kind of content), the error message if refused.

    python -m cluster.bench.api_vs_peer --base-url http://127.0.0.1:8000/v1 --model NAME \
        --json /tmp/api_vs_peer.mmserve.json
    python -m cluster.bench.api_vs_peer --merge mmserve=/tmp/a.json vllm=/tmp/b.json   # one table

Importing this module starts nothing; ``run_requests`` is the entry for tests.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from collections.abc import Callable
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


def _tool(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "description": f"{name} tool", "parameters": schema},
    }


TOOLS = [_tool("get_weather", WEATHER_SCHEMA), _tool("get_time", TIME_SCHEMA)]
RESP_TOOLS = [
    {"type": "function", "name": n, "description": f"{n} tool", "parameters": s} for n, s in SCHEMAS.items()
]


def image_data_url(seed: int = 0) -> str:
    return "data:image/png;base64," + base64.b64encode(make_image_bytes(64, 48, seed=seed)).decode()


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _history(tool_content: Any) -> list[dict[str, Any]]:
    """User asks, the assistant called get_weather, the tool answered with ``tool_content``."""
    return [
        _user("What is the weather in Paris?"),
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


def _calls_summary(calls: list[tuple[str | None, str | None]]) -> dict[str, Any]:
    return {
        "tool_calls": len(calls),
        "calls": [f"{n}: {check_call(n, a)}" for n, a in calls],
        "all_valid": bool(calls) and all(check_call(n, a) == "valid" for n, a in calls),
        "raw_calls": [[n, a] for n, a in calls],
    }


def _short(text: str | None, n: int = 80) -> str:
    return "" if text is None else (text[:n] + ("…" if len(text) > n else ""))


# ---------------------------------------------------------------------------------------------------
# Chat completions


def _chat(client: openai.OpenAI, model: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    r = client.chat.completions.create(model=model, max_tokens=max_tokens, temperature=0, **kw)
    ch = r.choices[0]
    calls = [
        (c.function.name, c.function.arguments) for c in (ch.message.tool_calls or []) if c.type == "function"
    ]
    return {
        **_calls_summary(calls),
        "finish_reason": ch.finish_reason,
        "content_kind": content_kind(ch.message.content),
        "content": _short(ch.message.content),
        "prompt_tokens": r.usage.prompt_tokens if r.usage else None,
    }


def _chat_stream(client: openai.OpenAI, model: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
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
        **_calls_summary([(n, a) for n, a in (calls[i] for i in sorted(calls))]),
        "finish_reason": finish,
        "content_kind": content_kind(text),
        "content": _short(text),
        "chunks": chunks,
        "prompt_tokens": prompt_tokens,
    }


# ---------------------------------------------------------------------------------------------------
# Completions and responses


def _completion(client: openai.OpenAI, model: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    r = client.completions.create(model=model, max_tokens=max_tokens, temperature=0, **kw)
    ch = r.choices[0]
    lp = ch.logprobs
    return {
        "finish_reason": ch.finish_reason,
        "content_kind": content_kind(ch.text),
        "content": _short(ch.text),
        "logprobs_tokens": None if lp is None or lp.tokens is None else len(lp.tokens),
        "prompt_tokens": r.usage.prompt_tokens if r.usage else None,
    }


def _response_out(resp: Any) -> dict[str, Any]:
    kinds = [o.type for o in resp.output]
    calls = [(o.name, o.arguments) for o in resp.output if o.type == "function_call"]
    text = resp.output_text
    return {
        **_calls_summary(calls),
        "finish_reason": resp.status,
        "content_kind": "items: " + ",".join(kinds) + ("; " + content_kind(text) if text else ""),
        "content": _short(text),
        "prompt_tokens": resp.usage.input_tokens if resp.usage else None,
    }


def _responses(client: openai.OpenAI, model: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    return _response_out(
        client.responses.create(model=model, max_output_tokens=max_tokens, temperature=0, **kw)
    )


def _responses_stream(client: openai.OpenAI, model: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
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
        _response_out(final)
        if final is not None
        else {"finish_reason": None, "content_kind": "no final event"}
    )
    out["events"] = events
    return out


# ---------------------------------------------------------------------------------------------------
# The request set


Request = Callable[[openai.OpenAI, str, int], dict[str, Any]]


def request_set() -> list[tuple[str, str, Request]]:
    """(name, endpoint, send) in a fixed order."""
    img = image_data_url()
    ask = [_user("What is the weather in Paris? Use a tool.")]
    named = {"type": "function", "function": {"name": "get_weather"}}
    bad_schema = [_tool("get_weather", {"type": "object", "properties": "not a mapping"})]
    chat = "/v1/chat/completions"

    return [
        (
            "tools, tool_choice auto",
            chat,
            lambda c, m, n: _chat(c, m, n, messages=ask, tools=TOOLS, tool_choice="auto"),
        ),
        (
            "tool_choice required",
            chat,
            lambda c, m, n: _chat(c, m, n, messages=ask, tools=TOOLS, tool_choice="required"),
        ),
        (
            "named function",
            chat,
            lambda c, m, n: _chat(c, m, n, messages=ask, tools=TOOLS, tool_choice=named),
        ),
        (
            "required, parallel_tool_calls false",
            chat,
            lambda c, m, n: _chat(
                c, m, n, messages=ask, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
            ),
        ),
        (
            "3-turn history, tool message text",
            chat,
            lambda c, m, n: _chat(c, m, n, messages=_history("18 C, sunny"), tools=TOOLS),
        ),
        (
            "tool message with an image",
            chat,
            lambda c, m, n: _chat(
                c,
                m,
                n,
                messages=_history(
                    [
                        {"type": "text", "text": "screenshot:"},
                        {"type": "image_url", "image_url": {"url": img}},
                    ]
                ),
                tools=TOOLS,
            ),
        ),
        (
            "required, streamed",
            chat,
            lambda c, m, n: _chat_stream(c, m, n, messages=ask, tools=TOOLS, tool_choice="required"),
        ),
        (
            "named, streamed",
            chat,
            lambda c, m, n: _chat_stream(c, m, n, messages=ask, tools=TOOLS, tool_choice=named),
        ),
        (
            "completions, string prompt",
            "/v1/completions",
            lambda c, m, n: _completion(c, m, n, prompt="Hello, my name is"),
        ),
        (
            "completions, token ids",
            "/v1/completions",
            lambda c, m, n: _completion(c, m, n, prompt=[11, 12, 13, 14, 15]),
        ),
        (
            "completions, echo + logprobs",
            "/v1/completions",
            lambda c, m, n: _completion(c, m, min(n, 4), prompt="Hello, my name is", echo=True, logprobs=1),
        ),
        ("responses, text", "/v1/responses", lambda c, m, n: _responses(c, m, n, input="Say hello.")),
        (
            "responses, input_image",
            "/v1/responses",
            lambda c, m, n: _responses(
                c,
                m,
                n,
                input=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "Describe the image."},
                            {"type": "input_image", "image_url": img, "detail": "auto"},
                        ],
                    }
                ],
            ),
        ),
        (
            "responses, function tool",
            "/v1/responses",
            lambda c, m, n: _responses(c, m, n, input="What is the weather in Paris?", tools=RESP_TOOLS),
        ),
        (
            "responses, streamed",
            "/v1/responses",
            lambda c, m, n: _responses_stream(c, m, n, input="Say hello."),
        ),
        (
            "bad: tool_choice names unknown function",
            chat,
            lambda c, m, n: _chat(
                c,
                m,
                n,
                messages=ask,
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "nope"}},
            ),
        ),
        (
            "bad: duplicate tool names",
            chat,
            lambda c, m, n: _chat(c, m, n, messages=ask, tools=[TOOLS[0], TOOLS[0]]),
        ),
        ("bad: malformed tool schema", chat, lambda c, m, n: _chat(c, m, n, messages=ask, tools=bad_schema)),
        (
            "bad: unknown request field",
            chat,
            lambda c, m, n: _chat(c, m, n, messages=ask, extra_body={"not_a_field": 1}),
        ),
    ]


def run_one(
    client: openai.OpenAI, model: str, max_tokens: int, name: str, endpoint: str, send: Request
) -> dict[str, Any]:
    row: dict[str, Any] = {"name": name, "endpoint": endpoint}
    t0 = time.perf_counter()
    try:
        row.update(send(client, model, max_tokens))
        row["status"] = 200
    except openai.APIStatusError as e:
        row["status"] = e.status_code
        body = e.body if isinstance(e.body, dict) else {}
        err = body.get("error", body) if isinstance(body.get("error", body), dict) else {}
        row["error"] = _short(str(err.get("message") or e.message), 160)
        row["param"] = err.get("param")
    except Exception as e:  # a client-side failure (connection, SDK parsing): recorded, not raised
        row["status"] = "client error"
        row["error"] = _short(f"{type(e).__name__}: {e}", 160)
    row["seconds"] = round(time.perf_counter() - t0, 3)
    return row


def run_requests(
    base_url: str, model: str, max_tokens: int = 96, api_key: str = "EMPTY"
) -> list[dict[str, Any]]:
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    return [run_one(client, model, max_tokens, *r) for r in request_set()]


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    if row["status"] != 200:
        return f"**{row['status']}** {row.get('error', '')}".replace("|", "\\|").replace("\n", " ")
    parts = [f"200 {row.get('finish_reason')}", f"content: `{row.get('content_kind')}`"]
    if "tool_calls" in row:
        checks = [(n, check_call(n, a)) for n, a in row.get("raw_calls", [])]
        ok = bool(checks) and all(c == "valid" for _, c in checks)
        v = "valid" if ok else ("; ".join(f"{n}: {c}" for n, c in checks) or "none")
        parts.append(f"tool_calls: {row['tool_calls']} ({v})")
    if row.get("prompt_tokens") is not None:
        parts.append(f"prompt {row['prompt_tokens']} tokens")
    if row.get("logprobs_tokens") is not None:
        parts.append(f"logprobs: {row['logprobs_tokens']} tokens")
    if row.get("events"):
        parts.append("events: " + " → ".join(e.removeprefix("response.") for e in row["events"]))
    return "; ".join(parts).replace("|", "\\|").replace("\n", " ")


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    servers = list(results)
    names = [r["name"] for r in next(iter(results.values()))]
    by = {s: {r["name"]: r for r in rows} for s, rows in results.items()}
    lines = ["| # | request | " + " | ".join(servers) + " |", "|---|---|" + "---|" * len(servers)]
    for i, n in enumerate(names, 1):
        lines.append(f"| {i} | {n} | " + " | ".join(_cell(by[s].get(n)) for s in servers) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument("--json", help="write the raw outcomes here")
    p.add_argument("--label", default="server", help="column name in the printed table")
    p.add_argument("--merge", nargs="+", metavar="LABEL=PATH", help="print one table from saved JSONs")
    a = p.parse_args(argv)
    if a.merge:
        results = {}
        for item in a.merge:
            label, path = item.split("=", 1)
            with open(path) as f:
                results[label] = json.load(f)
        print(table(results))
        return 0
    if not a.base_url or not a.model:
        p.error("--base-url and --model are required (or --merge)")
    rows = run_requests(a.base_url, a.model, a.max_tokens, a.api_key)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(table({a.label: rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
