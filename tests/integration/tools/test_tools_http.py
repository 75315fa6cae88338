"""Tools in the prompt over HTTP (docs/tools.md): the three-turn agent loop on the tiny Qwen3-VL (its
released chat template, hermes tools) through the real ``openai`` client, every greedy answer equal
to HF ``generate`` on the same rendered prompt and pixels; the tool's screenshot encoded once and
served from the encoder cache on a repeat; a text-only chat with tools through the ingress's own
tokenizer; and the refusals naming their field, end to end."""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.hf_oracle import hf_generate
from tests.media import make_image_array, make_image_bytes

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3-vl"
MAX_TOKENS = 8
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "click",
            "description": "Click a point of the screen",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            },
        },
    },
    {"type": "function", "function": {"name": "screenshot", "parameters": {"type": "object"}}},
]


@pytest.fixture(scope="module")
def app(tool_app: dict[str, Any]) -> dict[str, Any]:
    return tool_app


def _screenshot(w: int, h: int, seed: int) -> tuple[dict[str, Any], Any]:
    from PIL import Image

    url = "data:image/png;base64," + base64.b64encode(make_image_bytes(w, h, seed=seed)).decode()
    return {"type": "image_url", "image_url": {"url": url}}, Image.fromarray(
        make_image_array(w, h, seed=seed)
    )


def _ask(client: OpenAI, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0, **kw
    )


def _hf(app: dict[str, Any], messages: list[dict[str, Any]], **media: Any) -> str:
    return hf_generate(app["dir"], messages, MAX_TOKENS, tools=TOOLS, **media)


def _dispatched(client: OpenAI) -> int:
    stats = httpx.get(str(client.base_url).replace("/v1/", "/stats"), timeout=30).json()
    return int(stats[MODEL]["encoder_items_dispatched"])


def test_three_turn_agent_loop_equals_hf_and_reuses_the_tool_screenshot(app: dict[str, Any]) -> None:
    client = app["client"]
    first_part, first_img = _screenshot(96, 64, seed=81)
    tool_part, tool_img = _screenshot(64, 96, seed=82)
    # turn 1: the user's text and screenshot, with the tools
    user = {"role": "user", "content": [{"type": "text", "text": "Open the settings."}, first_part]}
    hf_user = {"role": "user", "content": [{"type": "text", "text": "Open the settings."}, {"type": "image"}]}
    before = _dispatched(client)
    r1 = _ask(client, [user])
    assert r1.choices[0].message.content == _hf(app, [hf_user], images=[first_img])
    assert _dispatched(client) - before == 1
    # turn 2: the call the model made (as an agent keeps it: content null), the tool's answer with
    # the next screenshot; the final answer
    arguments = json.dumps({"x": 12, "y": 30})
    call = {"id": "call_1", "type": "function", "function": {"name": "click", "arguments": arguments}}
    history = [
        user,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "Now:"}, tool_part]},
    ]
    hf_history = [
        hf_user,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{**call, "function": {"name": "click", "arguments": {"x": 12, "y": 30}}}],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": [{"type": "text", "text": "Now:"}, {"type": "image"}],
        },
    ]
    expected = _hf(app, hf_history, images=[first_img, tool_img])
    r2 = _ask(client, history)
    assert r2.choices[0].message.content == expected
    assert (
        _dispatched(client) - before == 2
    )  # the first screenshot from the encoder cache, the tool's encoded
    # the same step again (an agent's retry): both screenshots from the encoder cache, the prompt's
    # full blocks from the prefix cache, the same answer
    r3 = _ask(client, history)
    assert r3.choices[0].message.content == expected
    assert _dispatched(client) - before == 2
    assert r2.usage is not None and r3.usage is not None
    cached = r3.usage.prompt_tokens_details.cached_tokens if r3.usage.prompt_tokens_details else 0
    assert cached >= r2.usage.prompt_tokens // 16 * 16 - 16, (cached, r2.usage.prompt_tokens)
    # the tool's screenshot sent alone in a user turn: the same mm_hash, still no encoder forward
    alone = _ask(client, [{"role": "user", "content": [tool_part, {"type": "text", "text": "And this?"}]}])
    assert alone.choices[0].message.content
    assert _dispatched(client) - before == 2


@pytest.mark.parametrize("family", ["qwen3.5", "gemma4"])
def test_an_agent_turn_of_the_other_families_equals_hf(app: dict[str, Any], family: str) -> None:
    """Qwen3.5 and Gemma 4 (their released templates): the user's screenshot, the model's call kept
    in history, the tool's text answer; the greedy answer equals HF ``generate``. An image in the tool's
    answer: Qwen3.5's template renders it (equal HF too); Gemma 4's renders only a tool result's text, so
    there it is a 400 naming the part, not a silent drop."""
    client, model_dir = app["client"], app["dirs"][family]
    part, img = _screenshot(96, 64, seed=83)
    tool_part, tool_img = _screenshot(64, 96, seed=84)
    call = {
        "id": "call_9",
        "type": "function",
        "function": {"name": "click", "arguments": '{"x": 3, "y": 4}'},
    }
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "Open the settings."}, part]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_9", "content": [{"type": "text", "text": "Clicked."}]},
    ]
    hf_messages = [
        {"role": "user", "content": [{"type": "text", "text": "Open the settings."}, {"type": "image"}]},
        {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {"name": "click", "arguments": {"x": 3, "y": 4}}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": [{"type": "text", "text": "Clicked."}]},
    ]  # fmt: skip

    def ask(msgs: list[dict[str, Any]]) -> Any:
        return client.chat.completions.create(
            model=f"tiny-{family}", messages=msgs, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0
        )

    expected = hf_generate(model_dir, hf_messages, MAX_TOKENS, tools=TOOLS, images=[img])
    assert ask(messages).choices[0].message.content == expected
    with_image = [*messages[:2], {**messages[2], "content": [messages[2]["content"][0], tool_part]}]
    if family == "gemma4":
        with pytest.raises(openai.BadRequestError) as e:
            ask(with_image)
        assert e.value.body["param"] == "messages[2].content[1]"  # type: ignore[index]
        return
    hf_with_image = [*hf_messages[:2], {**hf_messages[2], "content": [hf_messages[2]["content"][0], {"type": "image"}]}]  # fmt: skip
    expected = hf_generate(model_dir, hf_with_image, MAX_TOKENS, tools=TOOLS, images=[img, tool_img])
    assert ask(with_image).choices[0].message.content == expected


def test_text_chat_with_tools_equals_hf(app: dict[str, Any]) -> None:
    """No media: the ingress's tokenizer renders the tools, the call and its result."""
    call = {"id": "c7", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}
    messages = [
        {"role": "system", "content": "You drive a phone."},
        {"role": "user", "content": "Take a screenshot."},
        {"role": "assistant", "content": "Taking it.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c7", "content": "the screen is locked"},
    ]
    hf_messages = [
        *messages[:2],
        {**messages[2], "tool_calls": [{**call, "function": {"name": "screenshot", "arguments": {}}}]},
        messages[3],
    ]
    r = _ask(app["client"], messages, tool_choice="auto", parallel_tool_calls=True)
    assert r.choices[0].message.content == _hf(app, hf_messages)
    without = app["client"].chat.completions.create(
        model=MODEL, messages=messages[:2], max_tokens=MAX_TOKENS, temperature=0
    )
    assert without.usage is not None and r.usage is not None
    assert without.usage.prompt_tokens < r.usage.prompt_tokens - 50  # the tool block is in the prompt


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(500)]}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tool_choice": {"type": "function", "function": {"name": "scroll"}}}, "tool_choice"),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "tool", "tool_call_id": "x", "content": "?"},
                ]
            },
            "messages[1].tool_call_id",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "a",
                                "type": "function",
                                "function": {"name": "click", "arguments": "{x: 1"},
                            }
                        ],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_tool_input_is_a_400_naming_the_field(
    app: dict[str, Any], change: dict[str, Any], param: str
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": TOOLS,
        "max_tokens": 2,
        **change,
    }
    url = str(app["client"].base_url).rstrip("/") + "/chat/completions"
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
