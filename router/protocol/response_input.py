"""A Responses request's ``instructions`` and ``input`` as chat messages, each named by the request
path it came from (``instructions``, ``input``, ``input[2]``), so the chat route's normalisation,
templating and media handling serve it and its errors name the Responses field."""

from __future__ import annotations

from router.protocol.errors import bad_request
from router.protocol.openai import (
    ChatMessage,
    ContentPart,
    ImagePart,
    ImageURL,
    InputAudioPart,
    TextPart,
)
from router.protocol.openai import InputAudio as ChatInputAudio
from router.protocol.responses import (
    InputAudio,
    InputImage,
    InputPart,
    InputText,
    MessageItem,
    OutputText,
    Refusal,
    ResponsesRequest,
)


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
        messages.append(_message(item, where))
        paths.append(where)
    return messages, paths


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
