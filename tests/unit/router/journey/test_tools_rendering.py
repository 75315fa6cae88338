"""Tools reach the chat template as transformers renders them, on both sides that render a prompt:
the ingress's tokenizer (text-only chats, ``Orchestrator``) and an encoder replica's processor (chats
with media, ``Preprocessor``), each equal to HF's ``apply_chat_template(messages, tools=...)``, a row per
family whose released template takes tools (the tiny models carry those templates): Qwen3-VL (hermes),
Qwen3.5 (``<function=...>``), Gemma 4 (``<|tool_call>``; it renders only the text of a tool result, so
an image there is a 400 naming the part)."""

from __future__ import annotations

import base64
import io
from typing import Any, cast

import pytest
from PIL import Image

from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.processing import Preprocessor
from router.journey.orchestrator import Orchestrator
from router.protocol.errors import APIError
from router.protocol.messages import MessageLimits, NormalizedChat, normalize_messages
from router.protocol.openai import ChatCompletionRequest
from router.protocol.tool_use import template_tools
from tests.media import make_image_bytes
from tests.tiny_dirs import tiny_model_dir

LIMITS = MessageLimits(64, 256, 1 << 20, {"image": 4, "video": 1, "audio": 1})
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "screenshot", "parameters": {"type": "object"}}},
]
CALLS = [
    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
    {"id": "c2", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}},
]


# what each family's template writes for the tools, the call and the result (test 1's chat)
MARKS = {
    "qwen3-vl": ("<tools>", '"name": "get_weather"', "<tool_response>\nsunny"),
    "qwen3.5": ("<tools>", "<function=get_weather>\n<parameter=city>\nZürich", "<tool_response>\nsunny"),
    "gemma4": (
        "<|tool>declaration:get_weather{",
        '<|tool_call>call:get_weather{city:<|"|>Zürich<|"|>}',
        'response:get_weather{value:<|"|>sunny, 21 C<|"|>}',
    ),
}
IMAGE_IN_TOOL_RESULT = ("qwen3-vl", "qwen3.5")  # the families whose template renders it


def _normalized(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> NormalizedChat:
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "tools": tools})
    return normalize_messages(req.messages, LIMITS, None, template_tools(req.tools, req.tool_choice))


def _hf_calls() -> list[dict[str, Any]]:
    """The calls as HF's templates expect them: arguments a mapping."""
    import json

    return [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in CALLS
    ]


@pytest.mark.parametrize("family", list(MARKS))
def test_text_chat_with_tools_and_results_tokenizes_as_hf(family: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir(family))
    orch = Orchestrator(cast(Any, None), tok, block_size=4)
    assert orch.template_takes_tools
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Zürich, and a screenshot?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": CALLS},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "none taken"}]},
    ]
    ids = orch._tokenize_sync(_normalized(messages, TOOLS))
    hf_messages = [*messages[:2], {**messages[2], "tool_calls": _hf_calls()}, messages[3]]
    hf_messages.append({**messages[4], "content": "none taken"})
    expected = tok.apply_chat_template(hf_messages, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    assert ids == list(expected)
    text = tok.decode(ids)
    assert all(mark in text for mark in MARKS[family]), text
    without = orch._tokenize_sync(_normalized(messages[:2], None))
    assert MARKS[family][0] not in tok.decode(without)
    assert ("image" in orch.tool_result_modalities) == (family in IMAGE_IN_TOOL_RESULT)


@pytest.mark.parametrize("family", IMAGE_IN_TOOL_RESULT)
def test_images_in_user_and_tool_messages_preprocess_as_hf(family: str) -> None:
    """The agent loop's second request: a screenshot in the user turn, another in the tool's answer;
    both are items in prompt order, and the prompt ids equal HF's processor on the same pixels."""
    pre = Preprocessor(tiny_model_dir(family), MediaLimits(), {"image": 4}, 64 * 1024 * 1024)
    shots = [make_image_bytes(96, 64, seed=11), make_image_bytes(64, 96, seed=12)]
    url = [f"data:image/png;base64,{base64.b64encode(b).decode()}" for b in shots]
    messages: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Open the menu."},
                {"type": "image_url", "image_url": {"url": url[0]}},
            ],
        },
        {"role": "assistant", "content": None, "tool_calls": CALLS[1:]},
        {
            "role": "tool",
            "tool_call_id": "c2",
            "content": [
                {"type": "image_url", "image_url": {"url": url[1]}},
                {"type": "text", "text": "after"},
            ],
        },
    ]
    chat = _normalized(messages, TOOLS)
    out = pre.preprocess_sync(chat.messages)
    hf = pre.family.hf
    hf_messages = [
        {"role": "user", "content": [{"type": "text", "text": "Open the menu."}, {"type": "image"}]},
        {"role": "assistant", "content": "", "tool_calls": _hf_calls()[1:]},
        {
            "role": "tool",
            "tool_call_id": "c2",
            "content": [{"type": "image"}, {"type": "text", "text": "after"}],
        },
    ]
    text = hf.apply_chat_template(hf_messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in shots]
    ref = hf(text=[text], images=pil, return_tensors="pt")
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()
    assert len(out.items) == 2 and len({it.mm_hash for it in out.items}) == 2
    assert "<tool_response>\n<|vision_start|>" in text  # the tool's image sits in its response


def test_a_processor_template_without_tools_refuses_them_naming_tools() -> None:
    """The encoder side checks its own template too (a checkpoint's processor template may differ from
    its tokenizer's): tools that would be dropped are a 400 naming ``tools``."""
    from encoder_service.preprocess.errors import ToolsUnsupported
    from router.protocol.errors import from_exception

    pre = Preprocessor(tiny_model_dir("qwen2-vl"), MediaLimits(), {"image": 4}, 64 * 1024 * 1024)
    url = f"data:image/png;base64,{base64.b64encode(make_image_bytes(32, 32, seed=3)).decode()}"
    chat = _normalized(
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}], TOOLS
    )
    with pytest.raises(ToolsUnsupported) as e:
        pre.preprocess_sync(chat.messages)
    api = from_exception(e.value)
    assert api is not None and (api.status_code, api.param, api.code) == (400, "tools", "tools_unsupported")
    without = _normalized(
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}], None
    )
    assert len(pre.preprocess_sync(without.messages).items) == 1  # the same request without tools


def test_gemma4_tool_result_text_preprocesses_as_hf_and_its_image_is_refused_by_name() -> None:
    """Gemma 4's template reads ``role: "tool"`` messages itself (the name from the call with that id,
    the text of the parts) on the encoder side too; an image in a tool result, which it would drop,
    is a 400 naming the part."""
    from transformers import AutoTokenizer

    model_dir = tiny_model_dir("gemma4")
    pre = Preprocessor(model_dir, MediaLimits(), {"image": 4}, 64 * 1024 * 1024)
    shot = make_image_bytes(96, 64, seed=11)
    url = f"data:image/png;base64,{base64.b64encode(shot).decode()}"
    user = {
        "role": "user",
        "content": [
            {"type": "text", "text": "Open the menu."},
            {"type": "image_url", "image_url": {"url": url}},
        ],
    }
    messages: list[dict[str, Any]] = [
        user,
        {"role": "assistant", "content": None, "tool_calls": CALLS},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "menu open"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    out = pre.preprocess_sync(_normalized(messages, TOOLS).messages)
    hf_messages = [
        {"role": "user", "content": [{"type": "text", "text": "Open the menu."}, {"type": "image"}]},
        {"role": "assistant", "content": "", "tool_calls": _hf_calls()},
        *messages[2:],
    ]
    hf = pre.family.hf
    text = hf.apply_chat_template(hf_messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    ref = hf(text=[text], images=[Image.open(io.BytesIO(shot)).convert("RGB")], return_tensors="pt")
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()
    assert 'response:screenshot{value:<|"|>menu open<|"|>}' in text  # named by the call's id
    assert 'response:get_weather{value:<|"|>sunny<|"|>}' in text

    orch = Orchestrator(cast(Any, None), AutoTokenizer.from_pretrained(model_dir), block_size=4)
    with_image = [*messages[:2], {**messages[2], "content": [user["content"][1]]}]
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": with_image, "tools": TOOLS})
    with pytest.raises(APIError) as e:
        normalize_messages(req.messages, LIMITS, None, TOOLS, tool_media=orch.tool_result_modalities)
    assert (e.value.status_code, e.value.param) == (400, "messages[2].content[0]")
