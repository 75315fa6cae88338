"""A chat's prompt token ids on an encoder replica: the chat template (with the request's tools and
``chat_template_kwargs``, which ride on its first message), the family's tokenizer, each media
placeholder expanded to its item's embeddings."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, cast

from encoder_service.preprocess.errors import ToolsUnsupported
from encoder_service.preprocess.media_items import MediaItem
from encoder_service.preprocess.placeholders import expand_placeholders
from encoder_service.preprocess.processors.base import PromptFamily
from encoder_service.types import PreprocessedRequest


def render_prompt(
    family: PromptFamily,
    model_id: str,
    template_messages: Sequence[Mapping[str, object]],
    items: list[MediaItem],
    takes_tools: bool,
) -> PreprocessedRequest:
    """``takes_tools``: whether the model's chat template has a place for tools (a request with tools
    to one that has not is ``ToolsUnsupported``)."""
    hf = family.hf
    first = template_messages[0] if template_messages else {}
    tools = first.get("tools")  # the request's tool definitions ride on its first message
    if tools is not None and not takes_tools:
        raise ToolsUnsupported(f"the chat template of model {model_id!r} has no place for tools")
    template_kwargs = cast(dict[str, Any], first.get("chat_template_kwargs") or {})  # checked at the ingress
    if tools is not None or "chat_template_kwargs" in first:
        rest = {k: v for k, v in first.items() if k not in ("tools", "chat_template_kwargs")}
        template_messages = [rest, *template_messages[1:]]
    text = hf.apply_chat_template(
        template_messages, tools=tools, add_generation_prompt=True, tokenize=False, **template_kwargs
    )
    text = family.prompt_text(text)
    ids = list(family.tokenizer(text)["input_ids"])
    out_ids, mm_items = expand_placeholders(family, ids, items)
    kwargs: dict[str, object] = {m: family.log_kwargs(m) for m in sorted({it.ref.modality for it in items})}
    return PreprocessedRequest(out_ids, mm_items, kwargs)


def text_chars(template_messages: Sequence[Mapping[str, object]]) -> int:
    """The text the template gets: each message's content is a string or a list of parts (``collect_media``)."""
    n = 0
    for m in template_messages:
        tool_fields = {k: m[k] for k in ("tools", "tool_calls") if k in m}  # as the template writes them
        n += len(json.dumps(tool_fields, ensure_ascii=False)) if tool_fields else 0
        content = m["content"]
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):
            n += sum(len(p.get("text", "")) for p in content)
    return n
