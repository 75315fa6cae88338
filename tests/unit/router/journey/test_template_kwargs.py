"""``chat_template_kwargs`` (router/protocol/template_kwargs.py): bounded, the server's own names refused by
name, and passed to the template on both sides that render a prompt — the ingress's tokenizer (text-only
chats) and an encoder replica's processor (chats with media) — each equal to HF's
``apply_chat_template(..., enable_thinking=False)`` on the tiny Qwen3.5 (its released template)."""

from __future__ import annotations

import base64
import io
from typing import Any, cast

import pytest
from PIL import Image
from pydantic import ValidationError

from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.processing import Preprocessor
from router.journey.orchestrator import Orchestrator
from router.protocol.messages import MessageLimits, NormalizedChat, normalize_messages
from router.protocol.openai import ChatCompletionRequest
from router.protocol.template_kwargs import MAX_TEMPLATE_KWARGS, template_kwargs_for
from tests.media import make_image_bytes
from tests.tiny_dirs import tiny_model_dir

LIMITS = MessageLimits(64, 256, 1 << 20, {"image": 4, "video": 1, "audio": 1})
OFF = {"enable_thinking": False}


def _request(kwargs: object) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
    return ChatCompletionRequest.model_validate(body)


def _chat(
    messages: list[dict[str, Any]], kwargs: dict[str, Any] | None, read: frozenset[str]
) -> NormalizedChat:
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": messages, "chat_template_kwargs": kwargs}
    )
    return normalize_messages(
        req.messages, LIMITS, template_kwargs=template_kwargs_for(req.chat_template_kwargs, read)
    )


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"add_generation_prompt": False}, "add_generation_prompt"),
        ({"messages": []}, "messages"),
        ({"tools": []}, "tools"),
        ({"chat_template": "{{ 1 }}"}, "chat_template"),
        ({"documents": []}, "documents"),
        ({"bos_token": "x"}, "bos_token"),
        ({"not-an-identifier": 1}, "not-an-identifier"),
        ({f"k{i}": i for i in range(MAX_TEMPLATE_KWARGS + 1)}, "at most 16 keys"),
        ({"big": "x" * 5000}, "characters as JSON"),
    ],
)
def test_bad_kwargs_are_refused_by_name(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ValidationError) as e:
        _request(kwargs)
    err = e.value.errors()[0]
    assert err["loc"][0] == "chat_template_kwargs" and words in err["msg"]


def test_good_kwargs_pass_and_unread_ones_are_dropped() -> None:
    req = _request({"enable_thinking": False, "custom": {"a": [1, None]}})
    assert req.chat_template_kwargs == {"enable_thinking": False, "custom": {"a": [1, None]}}
    assert template_kwargs_for(req.chat_template_kwargs, frozenset({"enable_thinking"})) == OFF


def test_text_chat_renders_as_hf_with_thinking_off() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir("qwen3.5"))
    orch = Orchestrator(cast(Any, None), tok, block_size=4)
    assert "enable_thinking" in orch.template_variables
    messages = [{"role": "user", "content": "What is 2+2?"}]
    for kwargs, tail in ((OFF, "<think>\n\n</think>\n\n"), (None, "<think>\n")):
        ids = orch._tokenize_sync(_chat(messages, kwargs, orch.template_variables))
        expected = tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **(kwargs or {})
        )
        if not isinstance(expected, list):
            expected = expected["input_ids"]
        assert ids == list(expected)
        assert tok.decode(ids).endswith("<|im_start|>assistant\n" + tail)


def test_media_chat_renders_as_hf_with_thinking_off_and_both_sides_agree() -> None:
    model_dir = tiny_model_dir("qwen3.5")
    pre = Preprocessor(model_dir, MediaLimits(), {"image": 4}, 64 * 1024 * 1024)
    shot = make_image_bytes(64, 64, seed=5)
    url = f"data:image/png;base64,{base64.b64encode(shot).decode()}"
    messages: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}],
        }
    ]
    from transformers import AutoTokenizer

    orch = Orchestrator(cast(Any, None), AutoTokenizer.from_pretrained(model_dir), block_size=4)
    out = pre.preprocess_sync(_chat(messages, OFF, orch.template_variables).messages)
    hf = pre.family.hf
    hf_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]
    text = hf.apply_chat_template(
        hf_messages, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert text.endswith("<think>\n\n</think>\n\n")
    pil = [Image.open(io.BytesIO(shot)).convert("RGB")]
    assert out.prompt_token_ids == hf(text=[text], images=pil, return_tensors="pt")["input_ids"][0].tolist()
    # the ingress's text side renders the same template tail from the same kwargs
    text_only = orch._tokenize_sync(_chat([{"role": "user", "content": "?"}], OFF, orch.template_variables))
    assert out.prompt_token_ids[-len(text_only) :][-8:] == text_only[-8:]


def test_gemma4_thinking_on_renders_as_hf() -> None:
    """Gemma 4's template thinks only when asked: ``enable_thinking`` true leaves the thought channel to the
    model (its parser, ``gemma4``, then reads it); the default closes an empty one in the prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir("gemma4"))
    orch = Orchestrator(cast(Any, None), tok, block_size=4)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    for kwargs in ({"enable_thinking": True}, None):
        ids = orch._tokenize_sync(_chat(messages, kwargs, orch.template_variables))
        expected = tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **(kwargs or {})
        )
        if not isinstance(expected, list):
            expected = expected["input_ids"]
        assert ids == list(expected)
        assert tok.decode(ids).endswith("<|channel>thought\n<channel|>") == (kwargs is None)
