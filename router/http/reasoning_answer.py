"""The answer's reasoning (docs/reasoning.md), with a model's reasoning parser on: vLLM 0.32's fields —
``message.reasoning`` beside ``content`` non-streamed, ``delta.reasoning`` streamed — the content going on
to the tool parser. A grammar (structured outputs, ``tool_choice`` required or named) while the model may
think is refused naming both fields: vLLM applies it once the reasoning ends, which mmserve's grammar
engine does not do yet."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from llm_service.sampling_params import SamplingParams
from llm_service.tools.formats import ToolFormat
from llm_service.tools.reasoning import Lane, ReasoningFormat, ReasoningStream, reasoning_format
from router.http.sse import ChunkRenderer
from router.http.tool_answer import tool_message
from router.protocol.chat_output import AssistantMessage
from router.protocol.errors import bad_request


@dataclass(frozen=True)
class Thinking:
    """A model's reasoning parser for one request's prompt (rendered with ``template_kwargs``)."""

    fmt: ReasoningFormat
    template_kwargs: Mapping[str, object]

    @staticmethod
    def of(format_name: str | None, template_kwargs: Mapping[str, object]) -> Thinking | None:
        return None if format_name is None else Thinking(reasoning_format(format_name), template_kwargs)

    def parse(self, text: str) -> tuple[str | None, str | None]:
        return self.fmt.parse(text, self.template_kwargs)

    def stream(self) -> ReasoningStream:
        return self.fmt.stream(self.template_kwargs)

    @property
    def may_think(self) -> bool:
        """The answer may open with reasoning: the prompt opened it (Qwen3.5 unless ``enable_thinking``
        is false) or the request switched thinking on (Gemma 4's ``enable_thinking``)."""
        return self.stream().in_reasoning or self.template_kwargs.get("enable_thinking") is True

    def check_grammar(self, params: SamplingParams) -> None:
        """A 400 naming the grammar's field and ``chat_template_kwargs`` when both are asked."""
        if params.structured is None or not self.may_think:
            return
        field = "tool_choice" if params.structured.field == "tools" else params.structured.field
        raise bad_request(
            f"{field} constrains the answer, but this model thinks first (reasoning parser "
            f"{self.fmt.name!r}) and mmserve cannot hold the grammar back until the reasoning ends; "
            'send chat_template_kwargs {"enable_thinking": false} or leave out ' + field,
            code="grammar_with_reasoning",
            param=field,
        )


class ReasoningDeltas:
    """One streamed answer's text -> its ``delta.reasoning`` events and the content text that goes on
    (to the tool parser or as ``delta.content``). No part of a marker goes out as text."""

    def __init__(self, thinking: Thinking, renderer: ChunkRenderer) -> None:
        self.stream, self.renderer = thinking.stream(), renderer

    def split(self, text: str, finished: bool) -> tuple[str, str]:
        """``(events of the reasoning in text, the content in text)``."""
        parts = self.stream.feed(text) + (self.stream.finish() if finished else [])
        events = "".join(
            self.renderer.raw(json.dumps({"reasoning": t}, ensure_ascii=False))
            for lane, t in parts
            if lane is Lane.REASONING
        )
        return events, "".join(t for lane, t in parts if lane is Lane.CONTENT)


def answer_message(
    text: str, finish: str | None, fmt: ToolFormat | None, thinking: Thinking | None
) -> tuple[AssistantMessage, str | None]:
    """The non-streamed message of the answer's ``text``: its reasoning split off (``content`` None when
    nothing is left, as vLLM), the rest parsed for tool calls; and its finish reason."""
    reasoning, content = thinking.parse(text) if thinking is not None else (None, text)
    message = AssistantMessage(content=content)
    if fmt is not None:
        message, finish = tool_message(fmt, content or "", finish)
    message.reasoning = reasoning
    return message, finish
