"""Tool calls in the answer over HTTP, with the real ``openai`` client, on a tiny model (random
weights) whose chat template takes tools. ``required`` and a named function: the grammar of calls
makes even random weights write a call to an allowed function whose arguments validate against its
schema (``jsonschema``), streamed and not, ``n`` > 1 too. ``auto``: the output forced by a
``structured_outputs`` regex (text, then two parallel calls) parses into exactly those calls.

A row per family (``FAMILIES``, all served by the package's one app): those whose released template
takes tools, and the four served with a shipped tool template as their ``chat_template`` (Qwen2-VL,
Qwen2.5-VL and Qwen2-Audio: hermes; Gemma 3: pythonic); without it they answer 400 naming ``tools``
(docs/tools.md, tests/integration/e2e/test_errors.py). Each family's calls stream with their arguments
in pieces, but pythonic ones (a call list is parsed when it ends).
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest
from openai import OpenAI

from tests.integration.tools.conftest import OVERRIDE_FAMILIES, TOOL_FAMILIES

FAMILIES = [*TOOL_FAMILIES, *OVERRIDE_FAMILIES]  # (tiny family, as `tiny:` names it)
WHOLE_ARGUMENTS = {"gemma3"}  # pythonic: a call's arguments come in one delta
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "units": {"type": "string", "maxLength": 3},
        "days": {"type": "integer"},
        "alerts": {"type": "boolean"},
    },
    "required": ["city", "alerts"],
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["CET", "UTC"]}},
    "required": ["zone"],
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES: list[Any] = [{"role": "user", "content": "Weather in Paris, and the time?"}]
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def client(tool_app: dict[str, Any]) -> OpenAI:
    return tool_app["client"]  # type: ignore[no-any-return]


def _valid(calls: list[tuple[str, str]], allowed: set[str]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in allowed
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _ask(
    client: OpenAI, family: str, **kw: Any
) -> tuple[list[tuple[str | None, list[tuple[str, str]], str | None]], Any]:
    """Each choice's (content, calls as (name, arguments), finish_reason), non-streamed."""
    r = client.chat.completions.create(
        model=f"tiny-{family}", messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS, **kw
    )
    out = []
    for c in r.choices:
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        for t in c.message.tool_calls or []:
            assert t.type == "function" and re.fullmatch(r"call_[A-Za-z0-9]{24}", t.id)
        out.append((c.message.content, calls, c.finish_reason))
    return out, r


def _stream(
    client: OpenAI, family: str, **kw: Any
) -> dict[int, tuple[str | None, list[tuple[str, str]], str | None]]:
    """The streamed choices reassembled from their deltas (ids and names first, then arguments)."""
    content: dict[int, str] = {}
    calls: dict[int, dict[int, list[str]]] = {}
    pieces: dict[tuple[int, int], int] = {}  # (choice, call) -> argument deltas
    finish: dict[int, str | None] = {}
    for chunk in client.chat.completions.create(
        model=f"tiny-{family}", messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS, stream=True, **kw
    ):
        for c in chunk.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
            for t in c.delta.tool_calls or []:
                mine = calls.setdefault(c.index, {})
                if t.index not in mine:  # the call's first delta: id, type and name, arguments ""
                    assert t.id and t.type == "function" and t.function and t.function.name
                    assert t.function.arguments == ""
                    mine[t.index] = [t.function.name, ""]
                else:
                    assert t.id is None and t.function and t.function.name is None
                    mine[t.index][1] += t.function.arguments or ""
                    pieces[c.index, t.index] = pieces.get((c.index, t.index), 0) + 1
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    if family not in WHOLE_ARGUMENTS:
        assert all(n >= 2 for n in pieces.values()), pieces  # arguments in pieces, not whole
    return {
        i: (content.get(i) or None, [(n, a) for n, a in calls.get(i, {}).values()], finish.get(i))
        for i in finish
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_required_gives_valid_calls_streamed_and_not(client: OpenAI, family: str) -> None:
    choices, _ = _ask(client, family, tool_choice="required", n=2, seed=1)
    assert len(choices) == 2
    for content, calls, finish in choices:
        _valid(calls, set(SCHEMAS))
        assert content is None and finish == "tool_calls"
    streamed = _stream(client, family, tool_choice="required", n=2, seed=1, temperature=1.0)
    assert streamed.keys() == {0, 1}
    for content, calls, finish in streamed.values():
        _valid(calls, set(SCHEMAS))
        assert content is None and finish == "tool_calls"


@pytest.mark.parametrize("family", FAMILIES)
def test_named_function_and_one_call(client: OpenAI, family: str) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in (2, 3):
        choices, _ = _ask(client, family, tool_choice=named, parallel_tool_calls=False, seed=seed)
        ((_, calls, finish),) = choices
        assert len(calls) == 1 and finish == "tool_calls"
        _valid(calls, {"get_time"})
    streamed = _stream(client, family, tool_choice=named, parallel_tool_calls=False, seed=4)
    assert len(streamed[0][1]) == 1
    _valid(streamed[0][1], {"get_time"})


# an answer with text then two parallel calls, as each family's format writes it
HERMES = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "alerts": true}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)
SCRIPTS = {
    "qwen3-vl": HERMES,
    "qwen3.5": (
        "Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=alerts>\ntrue\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>"
    ),
    "gemma4": (
        'Let me check.<|tool_call>call:get_weather{alerts:true,city:<|"|>Paris<|"|>}<tool_call|>'
        '<|tool_call>call:get_time{zone:<|"|>CET<|"|>}<tool_call|>'
    ),
    "qwen2-vl": HERMES,
    "qwen2.5-vl": HERMES,
    "qwen2-audio": HERMES,
    "gemma3": '[get_weather(city="Paris", alerts=True), get_time(zone="CET")]',  # the whole answer
}
TEXT_BEFORE = {"gemma3": None}  # pythonic: no text before the list


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_parses_a_scripted_answer_exactly(client: OpenAI, family: str) -> None:
    script = SCRIPTS[family]
    forced = {"structured_outputs": {"regex": re.escape(script)}}
    want = [
        ("get_weather", {"city": "Paris", "alerts": True}),
        ("get_time", {"zone": "CET"}),
    ]
    choices, _ = _ask(client, family, tool_choice="auto", extra_body=forced)
    ((content, calls, finish),) = choices
    assert content == TEXT_BEFORE.get(family, "Let me check.")
    assert [(n, json.loads(a)) for n, a in calls] == want  # in the order written
    assert finish == "tool_calls"
    streamed = _stream(client, family, tool_choice="auto", extra_body=forced)
    assert streamed[0] == (content, calls, finish)  # the deltas reassemble to the message
    none, _ = _ask(client, family, tool_choice="none", extra_body=forced)
    assert none[0] == (script, [], "stop")  # none: no calls parsed


@pytest.mark.parametrize("family", FAMILIES)
def test_what_cannot_be_enforced_is_a_400_naming_the_field(client: OpenAI, family: str) -> None:
    patterned = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "^a+$"}}}}}]  # fmt: skip
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=f"tiny-{family}", messages=MESSAGES, tools=patterned, tool_choice="required", max_tokens=8
        )
    assert e.value.body["param"] == "tools[0].function.parameters"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=f"tiny-{family}",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
            max_tokens=8,
        )
    assert e.value.body["param"] == "tool_choice"  # type: ignore[index]
