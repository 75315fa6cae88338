"""``tool_choice`` -> the answer's parsing and the grammar of calls (router/protocol/tool_choice.py)."""

from __future__ import annotations

from typing import Any

import pytest

from router.protocol.errors import APIError
from router.protocol.openai import ChatCompletionRequest
from router.protocol.sampling import request_sampling_params
from router.protocol.tool_choice import answer_format, with_tool_choice

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]


def _req(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **kw}
    )


def _grammar(**kw: Any) -> str | None:
    req = _req(**kw)
    spec = with_tool_choice(request_sampling_params(req), req, "hermes").structured
    if spec is None:
        return None
    assert (spec.kind, spec.field) == ("grammar", "tools")
    return spec.value


def test_auto_and_none_parse_or_not_and_constrain_nothing() -> None:
    assert (
        _grammar(tool_choice="auto") is None and _grammar() is None and _grammar(tool_choice="none") is None
    )
    assert answer_format(_req(tool_choice="none"), "hermes") is None
    fmt = answer_format(_req(), "qwen3_xml")
    assert fmt is not None and fmt.name == "qwen3_xml" and set(fmt.schemas) == {"get_weather", "get_time"}


def test_required_allows_every_function_and_named_one() -> None:
    every = _grammar(tool_choice="required")
    assert every is not None and "get_weather" in every and "get_time" in every
    named = _grammar(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named is not None and "get_time" in named and "get_weather" not in named
    one = _grammar(tool_choice="required", parallel_tool_calls=False)
    assert every.splitlines()[0].endswith(")*")  # root: one call, then more
    assert one is not None and not one.splitlines()[0].endswith(")*")  # root: one call


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "number", "minimum": 0}},
                            },
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        ({"response_format": {"type": "json_object"}}, "tool_choice"),
        ({"structured_outputs": {"regex": "a+"}}, "tool_choice"),
    ],
)
def test_what_cannot_be_held_is_a_400_naming_the_field(kw: dict[str, Any], param: str) -> None:
    req = _req(tool_choice="required", **kw)
    with pytest.raises(APIError) as e:
        with_tool_choice(request_sampling_params(req), req, "hermes")
    assert e.value.status_code == 400 and e.value.param == param
