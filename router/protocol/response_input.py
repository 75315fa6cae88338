"""A Responses request's ``instructions`` and ``input`` as chat messages, each named by the request
path it came from (``instructions``, ``input``, ``input[2]``), so the chat route's normalisation,
templating and media handling serve it and its errors name the Responses field.

``function_call`` items become an assistant message's ``tool_calls`` (consecutive calls, and calls
right after the assistant's text, one message); a ``function_call_output`` becomes a ``tool``
message answering its ``call_id``, its parts (text, images) as the tool message's content."""

from __future__ import annotations

import re

from router.protocol.errors import APIError, bad_request
from router.protocol.openai import ChatMessage, ContentPart, ImagePart, ImageURL, InputAudioPart, TextPart
from router.protocol.openai import InputAudio as ChatInputAudio
from router.protocol.responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputAudio,
    InputImage,
    InputPart,
    InputText,
    MessageItem,
    OutputText,
    Refusal,
    ResponsesRequest,
)
from router.protocol.tools import FunctionCall, ToolCall


def chat_messages(req: ResponsesRequest) -> tuple[list[ChatMessage], list[str]]:
    """The chat messages of ``req`` and, beside each, the request path it came from."""
    messages: list[ChatMessage] = []
    paths: list[str] = []
    if req.instructions is not None:
        messages.append(ChatMessage(role="system", content=req.instructions))
        paths.append("instructions")
    if isinstance(req.input, str):
        messages.append(ChatMessage(role="user", content=req.input))
        paths.append("input")
        return messages, paths
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                # calls right after the assistant's text (or other calls) belong to that message
                last.tool_calls = [*(last.tool_calls or []), call]
                continue
            messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output
            content = (
                output
                if isinstance(output, str)
                else [_part(p, f"{where}.output[{j}]") for j, p in enumerate(output)]
            )
            messages.append(ChatMessage(role="tool", content=content, tool_call_id=item.call_id))
        else:
            messages.append(_message(item, where))
        paths.append(where)
    return messages, paths


_CHAT_PATH = re.compile(r"(tools\[\d+\])\.function\.|(input\[\d+\])\.tool_call_id")


def in_responses_terms(e: APIError) -> APIError:
    """A 400 that chat's checks raised about the messages or tools, its paths in the Responses
    request's terms (``tools[0].function.parameters`` -> ``tools[0].parameters``,
    ``input[2].tool_call_id`` -> ``input[2].call_id``, a tool result's ``input[2].content[1]`` ->
    ``input[2].output[1]``)."""

    def said(text: str) -> str:
        text = _CHAT_PATH.sub(lambda m: f"{m[1]}." if m[1] else f"{m[2]}.call_id", text)
        if e.code == "unsupported_tool_media":  # a tool message's part: a function_call_output's
            text = text.replace(".content[", ".output[")
        return text

    e.message = said(e.message)
    e.args = (e.message,)
    e.param = said(e.param) if e.param is not None else None
    return e


def _message(item: MessageItem, where: str) -> ChatMessage:
    if isinstance(item.content, str):
        return ChatMessage(role=item.role, content=item.content)
    parts = [_part(p, f"{where}.content[{j}]") for j, p in enumerate(item.content)]
    return ChatMessage(role=item.role, content=parts)


def _part(part: InputPart, where: str) -> ContentPart:
    if isinstance(part, InputText | OutputText):
        return TextPart(type="text", text=part.text)
    if isinstance(part, Refusal):
        return TextPart(type="text", text=part.refusal)
    if isinstance(part, InputImage):
        if part.file_id is not None:
            raise bad_request(
                f"{where}.file_id: file ids are not supported (this server keeps no files); "
                "send the image as image_url (an http(s) or data: URL)",
                code="unsupported_argument",
                param=f"{where}.file_id",
            )
        if part.image_url is None:
            raise bad_request(f"{where}: an input_image needs an image_url", param=f"{where}.image_url")
        return ImagePart(type="image_url", image_url=ImageURL(url=part.image_url, detail=part.detail))
    if isinstance(part, InputAudio):
        audio = ChatInputAudio(data=part.input_audio.data, format=part.input_audio.format)
        return InputAudioPart(type="input_audio", input_audio=audio)
    raise bad_request(f"{where}: unsupported content part", param=where)  # pragma: no cover
