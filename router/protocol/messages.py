"""Turn OpenAI chat messages into the preprocessor's normalised messages, enforcing count limits."""

from __future__ import annotations

import binascii
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, NotRequired, TypedDict

import pybase64

from encoder_service.types import MODALITIES, MediaRef, Modality
from router.protocol.errors import APIError, bad_request
from router.protocol.openai import (
    AudioURLPart,
    ChatMessage,
    ContentPart,
    ImagePart,
    InputAudioPart,
    TextPart,
    VideoPart,
)
from router.protocol.tool_use import template_tool_calls

_AUDIO_FORMATS = {"wav", "mp3", "flac", "ogg", "oga", "webm", "m4a"}


@dataclass(frozen=True)
class MessageLimits:
    max_messages: int
    max_content_parts: int
    max_media_bytes: int
    limit_mm_per_prompt: dict[str, int]


class NormalizedText(TypedDict):
    type: Literal["text"]
    text: str


class NormalizedMedia(TypedDict):
    type: Modality  # the ref's own modality
    media: MediaRef


NormalizedPart = NormalizedText | NormalizedMedia


class NormalizedMessage(TypedDict):
    """One chat message as the preprocessor reads it (``encoder_service.preprocess.media_items.Message``).

    What the chat template reads beyond role and content rides along: an assistant message's
    ``tool_calls`` (arguments parsed), a tool message's ``tool_call_id``, and the request's tool
    definitions (``tools``) on the first message only, so that both sides that render the prompt
    (the ingress's tokenizer, an encoder replica's processor) see them without another argument."""

    role: str  # "system" | "user" | "assistant" | "tool" ("developer" is read as "system")
    content: str | list[NormalizedPart]
    tool_calls: NotRequired[list[dict[str, Any]]]
    tool_call_id: NotRequired[str]
    tools: NotRequired[list[dict[str, Any]]]
    chat_template_kwargs: NotRequired[dict[str, Any]]  # the request's, on the first message only


class TextMessage(TypedDict):
    role: str
    content: str
    tool_calls: NotRequired[list[dict[str, Any]]]
    tool_call_id: NotRequired[str]


@dataclass(frozen=True)
class NormalizedChat:
    messages: list[NormalizedMessage]
    media: list[MediaRef]

    @property
    def has_media(self) -> bool:
        return bool(self.media)

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """The tool definitions the template gets (on the first message), None without tools."""
        return self.messages[0].get("tools") if self.messages else None

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """The request's ``chat_template_kwargs`` the template reads (on the first message), or {}."""
        return self.messages[0].get("chat_template_kwargs", {}) if self.messages else {}

    def count(self, modality: Modality) -> int:
        return sum(1 for m in self.media if m.modality == modality)

    @property
    def text_chars(self) -> int:
        """Characters of text in the chat (what templating and tokenizing cost grows with), the
        tools' definitions and the history's calls included."""
        n = 0
        for m in self.messages:
            n += tool_chars(m)
            content = m["content"]
            if isinstance(content, str):
                n += len(content)
            else:
                n += sum(len(p["text"]) for p in content if p["type"] == "text")
        return n


def _media_from_part(part: ContentPart, where: str, max_bytes: int) -> MediaRef:
    if isinstance(part, ImagePart):
        url = part.image_url.url if part.image_url else None
        ref = MediaRef("image", url=url, uuid=part.uuid)
    elif isinstance(part, VideoPart):
        url = part.video_url.url if part.video_url else None
        ref = MediaRef("video", url=url, uuid=part.uuid)
    elif isinstance(part, AudioURLPart):
        url = part.audio_url.url if part.audio_url else None
        ref = MediaRef("audio", url=url, uuid=part.uuid)
    elif isinstance(part, InputAudioPart):
        audio = part.input_audio
        if audio is None or audio.data is None:
            ref = MediaRef("audio", uuid=part.uuid)
        else:
            fmt = (audio.format or "wav").lower()
            if fmt not in _AUDIO_FORMATS:
                raise APIError(
                    415, f"{where}: unsupported input_audio format {fmt!r}", code="unsupported_media_type"
                )
            if len(audio.data) > max_bytes * 4 // 3 + 4:
                raise APIError(413, f"{where}: input_audio exceeds {max_bytes} bytes", code="media_too_large")
            try:
                data = pybase64.b64decode(audio.data, validate=True)
            except (binascii.Error, ValueError) as e:
                raise bad_request(f"{where}: input_audio.data is not valid base64", code="bad_media") from e
            ref = MediaRef("audio", data=data, format=fmt, uuid=part.uuid)
    else:  # pragma: no cover - the discriminated union admits nothing else
        raise bad_request(f"{where}: unsupported content part")
    if ref.url is None and ref.data is None and ref.uuid is None:
        raise bad_request(f"{where}: a {ref.modality} part needs a url, data or a uuid", code="bad_media")
    return ref


def normalize_messages(
    messages: list[ChatMessage],
    limits: MessageLimits,
    tenant: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    *,
    field: str = "messages",
    paths: Sequence[str] | None = None,
    tool_media: frozenset[str] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> NormalizedChat:
    """OpenAI messages -> ``[{"role", "content": str | [{"type": "text"|modality, ...}]}]`` + media refs.

    Each media ref carries ``tenant``: its ``uuid`` is a name in that tenant's namespace only.
    ``tools``: the request's checked definitions (``tool_use.template_tools``), put on the first
    message. Media is read in user and tool messages, in prompt order either way. Errors name
    ``field`` and each message by ``paths[i]`` (``messages[i]`` unless given: another endpoint's
    request maps its own items onto chat messages). ``tool_media``: the modalities the chat template
    renders in a tool result (``chat_template.tool_result_modalities``; None: all); another is a 400
    naming the part, not a silent drop. ``template_kwargs``: the checked ``chat_template_kwargs`` the
    template reads (``template_kwargs.template_kwargs_for``), put on the first message beside ``tools``."""
    if len(messages) > limits.max_messages:
        raise bad_request(f"too many messages: {len(messages)} > {limits.max_messages}", param=field)
    out: list[NormalizedMessage] = []
    media: list[MediaRef] = []
    num_parts = 0
    called: set[str] = set()  # ids of the calls the history's assistant messages made
    for i, msg in enumerate(messages):
        role = "system" if msg.role == "developer" else msg.role
        extra = _tool_fields(msg, paths[i] if paths is not None else f"messages[{i}]", called)
        if msg.content is None or isinstance(msg.content, str):
            out.append({"role": role, "content": msg.content or "", **extra})  # type: ignore[typeddict-item]
            num_parts += 1
            continue
        parts: list[NormalizedPart] = []
        for j, part in enumerate(msg.content):
            num_parts += 1
            where = f"{paths[i] if paths is not None else f'messages[{i}]'}.content[{j}]"
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
                continue
            if role not in ("user", "tool"):
                raise bad_request(f"{where}: media is only accepted in user and tool messages", param=where)
            ref = _media_from_part(part, f"{where} (media item {len(media)})", limits.max_media_bytes)
            if role == "tool" and tool_media is not None and ref.modality not in tool_media:
                raise bad_request(
                    f"{where}: this model's chat template renders only the text of a tool result, not its "
                    f"{ref.modality}; send the {ref.modality} in a user message",
                    code="unsupported_tool_media",
                    param=where,
                )
            if tenant is not None:
                ref = replace(ref, tenant=tenant)
            parts.append({"type": ref.modality, "media": ref})
            media.append(ref)
        out.append({"role": role, "content": parts, **extra})  # type: ignore[typeddict-item]
    if num_parts > limits.max_content_parts:
        raise bad_request(f"too many content parts: {num_parts} > {limits.max_content_parts}", param=field)
    if tools:
        out[0]["tools"] = tools
    if template_kwargs:
        out[0]["chat_template_kwargs"] = template_kwargs
    chat = NormalizedChat(out, media)
    for modality in MODALITIES:
        n, cap = chat.count(modality), limits.limit_mm_per_prompt.get(modality, 0)
        if n > cap:
            raise bad_request(
                f"{n} {modality} items exceed limit_mm_per_prompt[{modality!r}]={cap}", code="too_many_items"
            )
    return chat


def _tool_fields(msg: ChatMessage, at: str, called: set[str]) -> dict[str, Any]:
    """The message's tool fields as the template reads them, checked against the history so far:
    calls only in assistant messages (arguments a JSON object), a tool message answering a call an
    earlier assistant message made. Each error is a 400 naming the field."""
    if msg.tool_calls is not None and msg.role != "assistant":
        where = f"{at}.tool_calls"
        raise bad_request(f"{where}: only assistant messages carry tool calls", param=where)
    if msg.tool_call_id is not None and msg.role != "tool":
        where = f"{at}.tool_call_id"
        raise bad_request(f"{where}: only tool messages answer a tool call", param=where)
    if msg.tool_calls:
        called.update(call.id for call in msg.tool_calls)
        return {"tool_calls": template_tool_calls(msg.tool_calls, f"{at}.tool_calls")}
    if msg.role != "tool":
        return {}
    where = f"{at}.tool_call_id"
    if msg.tool_call_id is None:
        raise bad_request(f"{where}: a tool message needs the id of the call it answers", param=where)
    if msg.tool_call_id not in called:
        raise bad_request(
            f"{where}: {msg.tool_call_id!r} answers no tool call of an earlier assistant message",
            param=where,
        )
    return {"tool_call_id": msg.tool_call_id}


def tool_chars(message: Mapping[str, object]) -> int:
    """The characters a message's tool fields add to the prompt (its ``tools``, its ``tool_calls``),
    as JSON: 0 without them. ``encoder_service.preprocess.processing`` counts them the same way."""
    extra = {k: message[k] for k in ("tools", "tool_calls") if k in message}
    return len(json.dumps(extra, ensure_ascii=False)) if extra else 0


def text_only_messages(chat: NormalizedChat) -> list[TextMessage]:
    """The chat with string content only (for the tokenizer's chat template on text-only requests)."""
    flat: list[TextMessage] = []
    for m in chat.messages:
        content = m["content"]
        if isinstance(content, list):
            content = "".join(p["text"] for p in content if p["type"] == "text")
        text: TextMessage = {"role": m["role"], "content": content}
        if "tool_calls" in m:
            text["tool_calls"] = m["tool_calls"]
        if "tool_call_id" in m:
            text["tool_call_id"] = m["tool_call_id"]
        flat.append(text)
    return flat


def inline_media(messages: Sequence[NormalizedMessage], max_chars: int) -> bool:
    """Every media item carries its bytes inline (raw or a ``data:`` URL, at most
    ``max_chars`` in all) or a uuid alone: what the hit path may hash on the ingress's loop.
    Anything it would have to fetch goes to ``prepare``."""
    total = 0
    for msg in messages:
        content = msg.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            ref = part.get("media")
            if not isinstance(ref, MediaRef):
                continue
            if ref.data is not None:
                total += len(ref.data)
            elif ref.url is not None:
                if not ref.url.startswith("data:"):
                    return False
                total += len(ref.url)
    return total <= max_chars
