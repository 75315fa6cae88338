"""The ``chat_template`` override over HTTP (docs/tools.md): the four families whose checkpoints ship no
tool section, served with the shipped tool templates (the package's app), answer a chat with tools as
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
from tests.integration.tools.conftest import OVERRIDE_FAMILIES
from tests.media import make_audio_array, make_audio_bytes, make_image_array, make_image_bytes

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


def _media(family: str, seed: int) -> tuple[dict[str, Any], dict[str, Any], str, Any]:
    """(the OpenAI part, HF's part, HF's processor keyword, the decoded media)."""
    from PIL import Image

    if family == "qwen2-audio":
        wav = base64.b64encode(make_audio_bytes(1.0, seed=seed)).decode()
        part = {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}
        return part, {"type": "audio"}, "audio", make_audio_array(1.0, seed=seed)
    url = "data:image/png;base64," + base64.b64encode(make_image_bytes(64, 48, seed=seed)).decode()
    image = Image.fromarray(make_image_array(64, 48, seed=seed))
    return {"type": "image_url", "image_url": {"url": url}}, {"type": "image"}, "images", image


@pytest.mark.parametrize("family", OVERRIDE_FAMILIES)
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

    part, hf_part, key, media = _media(family, seed=91)
    tool_part, hf_tool_part, _, tool_media = _media(family, seed=92)
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
    kw: dict[str, Any] = {key: [media, tool_media]}
    if key == "audio":
        kw["sampling_rate"] = 16000
    assert ask(agent_turn) == hf(hf_turn, **kw)
