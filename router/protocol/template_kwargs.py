"""``chat_template_kwargs`` (vLLM's extension of /v1/chat/completions): extra variables for the chat
template, such as Qwen3.5's ``enable_thinking``. Bounded here; the names the server sets itself when
it renders (the messages, the tools, the generation prompt, the tokenizer's special tokens, the
template's own helpers) are refused by name rather than let a request override them.

Both sides that render a prompt get the same dict on the request's first message
(``router/protocol/messages.py``), keeping only the names the model's template reads
(``mmcore.chat_template.template_variables``; vLLM drops the others the same way)."""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from typing import Any

MAX_TEMPLATE_KWARGS = 16
MAX_TEMPLATE_KWARGS_CHARS = 4096  # the dict as JSON
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")

# What transformers' apply_chat_template (tokenizer or processor) sets or consumes itself, and the
# helpers its jinja environment defines: a request may not set these.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "processor_kwargs",
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
        "raise_exception",
        "strftime_now",
        "namespace",
        "num_frames",
        "video_fps",
        "fps",
        "sampling_rate",
        "do_sample_frames",
        "load_audio_from_video",
        "video_load_backend",
    }
)


def check_template_kwargs(value: Mapping[str, Any]) -> dict[str, Any]:
    """``value`` if it is within bounds, else a ``ValueError`` naming the key at fault (pydantic
    reports it under ``chat_template_kwargs``). Values are whatever JSON the body held."""
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"at most {MAX_TEMPLATE_KWARGS} keys, got {len(value)}")
    for key in value:
        if not _NAME.fullmatch(key):
            raise ValueError(f"key {key[:80]!r} is not an identifier of at most 64 characters")
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(
                f"key {key!r} is set by the server when it renders the prompt; it cannot be given"
            )
    size = len(json.dumps(value, ensure_ascii=False))
    if size > MAX_TEMPLATE_KWARGS_CHARS:
        raise ValueError(f"{size} characters as JSON > {MAX_TEMPLATE_KWARGS_CHARS}")
    return dict(value)


def template_kwargs_for(value: Mapping[str, Any] | None, read: Collection[str]) -> dict[str, Any]:
    """The checked kwargs the template reads (``read``: its undeclared variables); the rest dropped."""
    return {k: v for k, v in (value or {}).items() if k in read}
