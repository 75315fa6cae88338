"""Function tools on ``/v1/responses`` with the ``openai`` client, on the tiny Qwen3-VL (its released
chat template takes tools; hermes calls): ``tool_choice`` required and named give ``function_call``
items to allowed functions whose arguments validate against their schemas, streamed (the
``function_call_arguments`` events reassemble to them) and not; ``auto`` is transformers' greedy
answer on the template with the tools; an agent turn (user text and a screenshot, the model's call,
the call's output holding an image) is transformers' greedy answer and the chat route's."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import torch
from openai import OpenAI
from PIL import Image

from tests.hf_oracle import load
from tests.media import make_image_bytes

MODEL = "tiny-qwen3-vl"
MAX = 8
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": "get_weather", "description": "The forecast.", "parameters": WEATHER},
    {"type": "function", "name": "get_time", "parameters": CLOCK},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}


@pytest.fixture(scope="module")
def served(tool_app: dict[str, Any]) -> tuple[OpenAI, Path]:
    return tool_app["client"], tool_app["dir"]


def _data_url(png: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(png).decode()


def _hf(
    model_dir: Path, messages: list[dict[str, Any]], tools: list[dict[str, Any]], images: list[Any]
) -> str:
    """transformers' greedy answer on the chat template with ``tools`` (chat's shape)."""
    proc, model = load(model_dir)
    text = proc.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    inputs = proc(text=[text], images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX, do_sample=False)
    return str(proc.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))


def _chat_tools() -> list[dict[str, Any]]:
    return [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]


def _valid_calls(output: list[Any], allowed: set[str]) -> list[Any]:
    calls = [o for o in output if o.type == "function_call"]
    assert calls, output
    for call in calls:
        assert call.name in allowed and call.call_id.startswith("call_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}])
def test_required_and_named_choices_give_calls_that_validate(
    served: tuple[OpenAI, Path], choice: Any, stream: bool
) -> None:
    client, _ = served
    ask: dict[str, Any] = {
        "model": MODEL,
        "input": "What is the weather in Paris?",
        "tools": TOOLS,
        "tool_choice": choice,
        "max_output_tokens": 96,
        "temperature": 0,
        "parallel_tool_calls": False,
    }
    allowed = {"get_weather", "get_time"} if choice == "required" else {"get_time"}
    if not stream:
        r = client.responses.create(**ask)
        assert r.status == "completed", r.output
        assert len(_valid_calls(r.output, allowed)) == 1  # parallel_tool_calls: false
        return
    with client.responses.stream(**ask) as s:
        events = list(s)
        final = s.get_final_response()
    (call,) = _valid_calls(final.output, allowed)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")  # type: ignore[union-attr]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == call.arguments and [d.arguments for d in done] == [call.arguments]  # type: ignore[union-attr]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_auto_is_hfs_greedy_answer_on_the_template_with_the_tools(served: tuple[OpenAI, Path]) -> None:
    client, model_dir = served
    text = "Is it sunny in Rome?"
    r = client.responses.create(model=MODEL, input=text, tools=TOOLS, max_output_tokens=MAX, temperature=0)
    expected = _hf(model_dir, [{"role": "user", "content": text}], _chat_tools(), [])
    assert r.output_text == expected  # random weights: no <tool_call>, the text as it is


def test_an_agent_turn_with_an_image_in_the_calls_output(served: tuple[OpenAI, Path]) -> None:
    """User text and a screenshot, the model's call, its output holding the next screenshot: the
    answer equals transformers' on the same messages and pixels, and the chat route's."""
    client, model_dir = served
    shot, after = make_image_bytes(64, 64, seed=41), make_image_bytes(56, 84, seed=42)
    arguments = '{"city": "Paris", "days": 2}'
    r = client.responses.create(
        model=MODEL,
        tools=TOOLS,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": _data_url(shot)},
                    {"type": "input_text", "text": "Check the weather."},
                ],
            },
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments},
            {
                "type": "function_call_output",
                "call_id": "call_1",
                "output": [
                    {"type": "input_text", "text": "Sunny; the screen now shows:"},
                    {"type": "input_image", "image_url": _data_url(after)},
                ],
            },
        ],
        max_output_tokens=MAX,
        temperature=0,
    )
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    hf_messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Check the weather."}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{**call, "function": {**call["function"], "arguments": json.loads(arguments)}}],
        },  # type: ignore[dict-item]
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": [{"type": "text", "text": "Sunny; the screen now shows:"}, {"type": "image"}],
        },
    ]
    images = [Image.open(io.BytesIO(png)).convert("RGB") for png in (shot, after)]
    expected = _hf(model_dir, hf_messages, _chat_tools(), images)
    assert r.output_text == expected
    assert r.usage is not None and r.usage.input_tokens > 2 * 16  # both images are in the prompt
    chat = client.chat.completions.create(
        model=MODEL,
        tools=_chat_tools(),  # type: ignore[arg-type]
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": _data_url(shot)}},
                    {"type": "text", "text": "Check the weather."},
                ],
            },
            {"role": "assistant", "content": None, "tool_calls": [call]},  # type: ignore[list-item]
            {
                "role": "tool",
                "tool_call_id": "call_1",
                "content": [
                    {"type": "text", "text": "Sunny; the screen now shows:"},
                    {"type": "image_url", "image_url": {"url": _data_url(after)}},  # type: ignore[list-item]
                ],
            },
        ],
        max_tokens=MAX,
        temperature=0,
    )
    assert chat.choices[0].message.content == expected


@pytest.mark.parametrize(
    "body,param",
    [
        (
            {"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]},
            "tools[0].parameters",
        ),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        ({"tools": [*TOOLS, TOOLS[0]]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]},
            "input[0].call_id",
        ),
        (
            {
                "input": [
                    {"type": "function_call", "call_id": "c", "name": "get_time", "arguments": "{not json"}
                ]
            },
            "input[0].tool_calls[0].function.arguments",  # the assistant message the call is part of
        ),
    ],
)
def test_bad_tools_are_400s_naming_the_field(
    served: tuple[OpenAI, Path], body: dict[str, Any], param: str
) -> None:
    client, _ = served
    url = str(client.base_url).rstrip("/") + "/responses"
    r = httpx.post(url, json={"model": MODEL, "input": "hi", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
