"""The ``chat_template`` override over HTTP (docs/tools.md): Qwen2.5-VL and Gemma 3, whose checkpoints
ship no tool section, served with the shipped tool templates (the package's app), answer a chat with
tools as
HF ``generate`` does on the prompt HF renders with ``apply_chat_template(chat_template=..., tools=...)``,
greedy, token for token: a text-only chat (the ingress's tokenizer renders it) and an agent turn with
media in the user's message and in the tool's result (the encoder's processor renders it)."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from openai import OpenAI

from cluster.tiny_model.released_templates import tool_template_path
from tests.hf_oracle import hf_generate
from tests.media import make_image_array, make_image_bytes

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
TOOLS: list[Any] = [
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
    }
]
CALL = {"id": "call_9", "type": "function", "function": {"name": "click", "arguments": '{"x": 3, "y": 4}'}}
HF_CALL = {**CALL, "function": {"name": "click", "arguments": {"x": 3, "y": 4}}}


def _screenshot(seed: int) -> tuple[dict[str, Any], Any]:
    """(the OpenAI part, the decoded image)."""
    from PIL import Image

    url = "data:image/png;base64," + base64.b64encode(make_image_bytes(64, 48, seed=seed)).decode()
    return {"type": "image_url", "image_url": {"url": url}}, Image.fromarray(
        make_image_array(64, 48, seed=seed)
    )


# the image families (Qwen2-VL shares Qwen2.5-VL's template; Qwen2-Audio hears: its tool calls are checked
# in test_tool_calls_http, its rendering on both sides in the unit test)
@pytest.mark.parametrize("family", ["qwen2.5-vl", "gemma3"])
def test_a_tool_chat_with_the_override_equals_hf(tool_app: dict[str, Any], family: str) -> None:
    client: OpenAI = tool_app["client"]
    model_dir = tool_app["dirs"][family]
    template = tool_template_path(family).read_text(encoding="utf-8")

    def ask(messages: list[Any]) -> str:
        r = client.chat.completions.create(
            model=f"tiny-{family}", messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0
        )
        assert r.choices[0].message.tool_calls is None
        return r.choices[0].message.content or ""

    def hf(messages: list[Any], **media: Any) -> str:
        return hf_generate(model_dir, messages, MAX_TOKENS, tools=TOOLS, chat_template=template, **media)

    text_chat: list[Any] = [
        {"role": "user", "content": "Open the settings."},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_9", "content": "Clicked."},
    ]
    assert ask(text_chat) == hf([*text_chat[:1], {**text_chat[1], "tool_calls": [HF_CALL]}, text_chat[2]])

    part, image = _screenshot(seed=91)
    tool_part, tool_image = _screenshot(seed=92)
    hf_part = hf_tool_part = {"type": "image"}
    agent_turn: list[Any] = [
        {"role": "user", "content": [{"type": "text", "text": "Open the settings."}, part]},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_9", "content": [{"type": "text", "text": "Now:"}, tool_part]},
    ]
    hf_turn = [
        {"role": "user", "content": [{"type": "text", "text": "Open the settings."}, hf_part]},
        {"role": "assistant", "content": "", "tool_calls": [HF_CALL]},
        {
            "role": "tool",
            "tool_call_id": "call_9",
            "content": [{"type": "text", "text": "Now:"}, hf_tool_part],
        },
    ]
    assert ask(agent_turn) == hf(hf_turn, images=[image, tool_image])
