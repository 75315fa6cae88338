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
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import openai

from cluster.bench.api_senders import (
    RESP_TOOLS,
    TOOLS,
    chat,
    chat_stream,
    check_call,
    completion,
    history,
    image_data_url,
    responses,
    responses_stream,
    short,
    tool,
    user,
)

# ---------------------------------------------------------------------------------------------------
# The request set


Request = Callable[[openai.OpenAI, str, int], dict[str, Any]]
CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"


def _send(send: Callable[..., dict[str, Any]], cap: int | None = None, **kw: Any) -> Request:
    """``send(client, model, max_tokens, **kw)``, with ``max_tokens`` at most ``cap``."""
    return lambda c, m, n: send(c, m, n if cap is None else min(n, cap), **kw)


def request_set() -> list[tuple[str, str, Request]]:
    """(name, endpoint, send) in a fixed order."""
    img = image_data_url()
    ask = [user("What is the weather in Paris? Use a tool.")]
    named = {"type": "function", "function": {"name": "get_weather"}}
    unknown = {"type": "function", "function": {"name": "nope"}}
    bad_schema = [tool("get_weather", {"type": "object", "properties": "not a mapping"})]
    screenshot = [{"type": "text", "text": "screenshot:"}, {"type": "image_url", "image_url": {"url": img}}]
    described = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Describe the image."},
                {"type": "input_image", "image_url": img, "detail": "auto"},
            ],
        }
    ]
    hello = "Hello, my name is"
    return [
        ("tools, tool_choice auto", CHAT, _send(chat, messages=ask, tools=TOOLS, tool_choice="auto")),
        ("tool_choice required", CHAT, _send(chat, messages=ask, tools=TOOLS, tool_choice="required")),
        ("named function", CHAT, _send(chat, messages=ask, tools=TOOLS, tool_choice=named)),
        (
            "required, parallel_tool_calls false",
            CHAT,
            _send(chat, messages=ask, tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
        ),
        (
            "3-turn history, tool message text",
            CHAT,
            _send(chat, messages=history("18 C, sunny"), tools=TOOLS),
        ),
        ("tool message with an image", CHAT, _send(chat, messages=history(screenshot), tools=TOOLS)),
        ("required, streamed", CHAT, _send(chat_stream, messages=ask, tools=TOOLS, tool_choice="required")),
        ("named, streamed", CHAT, _send(chat_stream, messages=ask, tools=TOOLS, tool_choice=named)),
        ("completions, string prompt", COMPLETIONS, _send(completion, prompt=hello)),
        ("completions, token ids", COMPLETIONS, _send(completion, prompt=[11, 12, 13, 14, 15])),
        (
            "completions, echo + logprobs",
            COMPLETIONS,
            _send(completion, 4, prompt=hello, echo=True, logprobs=1),
        ),
        ("responses, text", RESPONSES, _send(responses, input="Say hello.")),
        ("responses, input_image", RESPONSES, _send(responses, input=described)),
        (
            "responses, function tool",
            RESPONSES,
            _send(responses, input="What is the weather in Paris?", tools=RESP_TOOLS),
        ),
        ("responses, streamed", RESPONSES, _send(responses_stream, input="Say hello.")),
        (
            "bad: tool_choice names unknown function",
            CHAT,
            _send(chat, messages=ask, tools=TOOLS, tool_choice=unknown),
        ),
        ("bad: duplicate tool names", CHAT, _send(chat, messages=ask, tools=[TOOLS[0], TOOLS[0]])),
        ("bad: malformed tool schema", CHAT, _send(chat, messages=ask, tools=bad_schema)),
        ("bad: unknown request field", CHAT, _send(chat, messages=ask, extra_body={"not_a_field": 1})),
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
        row["error"] = short(str(err.get("message") or e.message), 160)
        row["param"] = err.get("param")
    except Exception as e:  # a client-side failure (connection, SDK parsing): recorded, not raised
        row["status"] = "client error"
        row["error"] = short(f"{type(e).__name__}: {e}", 160)
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
