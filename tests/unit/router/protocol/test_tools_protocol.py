"""Tools in a chat request (router/protocol/tools.py, tool_use.py, messages.py): what is accepted, and
every refusal a 400 naming its field, through the ingress's own body parsing (``read_body``'s
mapping of pydantic errors) and normalisation."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from mmcore.chat_template import template_takes_tools
from router.protocol.errors import APIError
from router.protocol.messages import MessageLimits, normalize_messages, text_only_messages
from router.protocol.openai import ChatCompletionRequest
from router.protocol.tool_use import template_tools
from router.protocol.tools import MAX_TOOLS

LIMITS = MessageLimits(64, 256, 1 << 20, {"image": 4, "video": 1, "audio": 1})
IMAGE = "data:image/png;base64,iVBORw0KGgo="

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SCREENSHOT = {"type": "function", "function": {"name": "screenshot", "parameters": {"type": "object"}}}


def agent_body(**extra: Any) -> dict[str, Any]:
    """The three-turn agent loop's last request: user text + image, the assistant's call, the tool's
    answer holding an image."""
    return {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what now?"},
                    {"type": "image_url", "image_url": {"url": IMAGE}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "screenshot", "arguments": "{}"},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "call_1",
                "content": [
                    {"type": "text", "text": "here"},
                    {"type": "image_url", "image_url": {"url": IMAGE}},
                ],
            },
        ],
        "tools": [WEATHER, SCREENSHOT],
        **extra,
    }


def param_of(body: dict[str, Any]) -> str | None:
    """The ``param`` of the 400 the ingress answers ``body`` with (as read_body and chat.py map it)."""
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        return ".".join(str(p) for p in first["loc"])
    with pytest.raises(APIError) as err:
        normalize_messages(req.messages, LIMITS, None, template_tools(req.tools, req.tool_choice))
    assert err.value.status_code == 400
    return err.value.param


def test_the_agent_loop_is_accepted_with_tool_fields_for_the_template() -> None:
    req = ChatCompletionRequest.model_validate(agent_body(tool_choice="auto", parallel_tool_calls=False))
    tools = template_tools(req.tools, req.tool_choice)
    assert tools == [WEATHER, SCREENSHOT]  # as sent (no null fields added)
    chat = normalize_messages(req.messages, LIMITS, None, tools)
    assert chat.tools == tools and chat.messages[0]["tools"] == tools
    assert [m.modality for m in chat.media] == ["image", "image"]  # the tool's image in prompt order
    call = chat.messages[1]
    assert call["content"] == "" and call["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "screenshot", "arguments": {}}}
    ]
    tool = chat.messages[2]
    assert tool["role"] == "tool" and tool["tool_call_id"] == "call_1"
    assert [p["type"] for p in tool["content"]] == ["text", "image"]
    flat = text_only_messages(chat)
    assert flat[1]["tool_calls"] == call["tool_calls"] and flat[2]["tool_call_id"] == "call_1"


@pytest.mark.parametrize(
    "choice", ["none", "auto", "required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_tool_choice_forms(choice: object) -> None:
    req = ChatCompletionRequest.model_validate(agent_body(tool_choice=choice))
    assert template_tools(req.tools, req.tool_choice) is not None


def test_arguments_are_parsed_for_the_template() -> None:
    body = agent_body()
    body["messages"][1]["tool_calls"][0]["function"]["arguments"] = '{"city": "Paris", "days": 2}'
    req = ChatCompletionRequest.model_validate(body)
    chat = normalize_messages(req.messages, LIMITS)
    assert chat.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 2}


def _with(path: list[Any], value: Any, **extra: Any) -> dict[str, Any]:
    body = agent_body(**extra)
    node: Any = body
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return body


def _tool(name: str, parameters: Any = None) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


BAD = [
    # malformed schemas
    (_with(["tools"], [_tool("f", {"type": "string"})]), "tools[0].function.parameters"),
    (
        _with(["tools"], [_tool("f", {"type": "object", "properties": {"a": {"type": "strin"}}})]),
        "tools[0].function.parameters",
    ),
    (_with(["tools"], [_tool("f", {"type": "object", "properties": ["a"]})]), "tools[0].function.parameters"),
    (_with(["tools"], [_tool("f", {"type": "object", "required": "a"})]), "tools[0].function.parameters"),
    (
        _with(["tools"], [WEATHER, _tool("g", {"type": "object", "properties": {"a": 3}})]),
        "tools[1].function.parameters",
    ),
    (_with(["tools"], [_tool("f", "not a schema")]), "tools.0.function.parameters"),
    (_with(["tools"], [{"type": "retrieval", "function": {"name": "f"}}]), "tools.0.type"),
    (_with(["tools"], [_tool("bad name!")]), "tools.0.function.name"),
    # duplicate names, too many tools, none
    (_with(["tools"], [WEATHER, SCREENSHOT, WEATHER]), "tools"),
    (_with(["tools"], [_tool(f"f{i}") for i in range(MAX_TOOLS + 1)]), "tools"),
    (_with(["tools"], [_tool(f"f{i}") for i in range(500)]), "tools"),
    (_with(["tools"], []), "tools"),
    # tool_choice
    (agent_body(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (agent_body(tool_choice="sometimes"), "tool_choice"),
    (agent_body(tool_choice={"type": "function"}), "tool_choice"),
    (_with(["tools"], None, tool_choice="required"), "tool_choice"),
    (
        _with(["tools"], None, tool_choice={"type": "function", "function": {"name": "screenshot"}}),
        "tool_choice",
    ),
    (agent_body(parallel_tool_calls="maybe"), "parallel_tool_calls"),
    # the history
    (_with(["messages", 2, "tool_call_id"], "call_9"), "messages[2].tool_call_id"),
    (_with(["messages", 2, "tool_call_id"], None), "messages[2].tool_call_id"),
    (
        _with(["messages", 1, "tool_calls", 0, "function", "arguments"], "{city: Paris"),
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        _with(["messages", 1, "tool_calls", 0, "function", "arguments"], "[1, 2]"),
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        _with(["messages", 1, "tool_calls", 0, "function", "arguments"], {"a": 1}),
        "messages.1.tool_calls.0.function.arguments",
    ),
    (_with(["messages", 1, "tool_calls", 0, "id"], ""), "messages.1.tool_calls.0.id"),
    (
        _with(["messages", 0, "tool_calls"], [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]),
        "messages[0].tool_calls",
    ),
    (_with(["messages", 0, "tool_call_id"], "call_1"), "messages[0].tool_call_id"),
    (
        _with(["messages", 1, "content"], [{"type": "image_url", "image_url": {"url": IMAGE}}]),
        "messages[1].content[0]",
    ),
    (_with(["messages", 2, "role"], "function"), "messages.2.role"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD)])
def test_each_refusal_names_its_field(body: dict[str, Any], param: str) -> None:
    assert param_of(body) == param


def test_a_call_answered_before_it_is_made_is_refused() -> None:
    body = agent_body()
    body["messages"] = [body["messages"][0], body["messages"][2], body["messages"][1]]
    assert param_of(body) == "messages[1].tool_call_id"


def test_schema_bounds_are_the_structured_output_bounds() -> None:
    deep: dict[str, Any] = {"type": "object"}
    node = deep
    for _ in range(40):
        node["properties"] = {"a": {"type": "object"}}
        node = node["properties"]["a"]
    assert param_of(_with(["tools"], [_tool("f", deep)])) == "tools[0].function.parameters"


def test_which_templates_take_tools() -> None:
    assert template_takes_tools("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}")
    assert template_takes_tools({"default": "{{ messages }}", "tool_use": "{% for t in tools %}{% endfor %}"})
    assert not template_takes_tools("{% set tools = [] %}{{ tools }}{{ messages }}")  # sets its own
    assert not template_takes_tools("{{ messages }}") and not template_takes_tools(None)


def test_unicode_in_arguments_survives() -> None:
    body = _with(["messages", 1, "tool_calls", 0, "function", "arguments"], json.dumps({"city": "Zürich"}))
    req = ChatCompletionRequest.model_validate(body)
    chat = normalize_messages(req.messages, LIMITS)
    assert chat.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Zürich"}


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(max_size=8)
    | st.sampled_from(["object", "string", "array"]),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                ["type", "properties", "required", "items", "anyOf", "enum", "$defs", "not", "x"]
            ),
            inner,
            max_size=5,
        )
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(JSON)
def test_any_parameters_are_a_schema_or_a_400_naming_them(parameters: object) -> None:
    """Whatever JSON a client puts in ``parameters``: accepted, or a 400 naming the field (never a 500)."""
    body = _with(["tools"], [{"type": "function", "function": {"name": "f", "parameters": parameters}}])
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        assert e.errors()[0]["loc"][:4] == ("tools", 0, "function", "parameters")
        return
    try:
        template_tools(req.tools, req.tool_choice)
    except APIError as e:
        assert (e.status_code, e.param) == (400, "tools[0].function.parameters")


def test_audio_in_a_tool_result_is_a_media_item_in_prompt_order() -> None:
    """Where the family hears, a tool's answer may hold a clip: one more item, after the user's image."""
    wav = base64.b64encode(b"RIFF....WAVEfmt ").decode()
    body = _with(
        ["messages", 2, "content"],
        [
            {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
            {"type": "text", "text": "heard"},
        ],
    )
    req = ChatCompletionRequest.model_validate(body)
    chat = normalize_messages(req.messages, LIMITS, "tenant-a", template_tools(req.tools, req.tool_choice))
    assert [m.modality for m in chat.media] == ["image", "audio"]
    assert chat.media[1].data == base64.b64decode(wav) and chat.media[1].tenant == "tenant-a"
    assert [p["type"] for p in chat.messages[2]["content"]] == ["audio", "text"]
