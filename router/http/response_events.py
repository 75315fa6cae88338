"""A response's output items as its text arrives, and the server-sent events of a streamed one, in the
order the ``openai`` SDK's ``client.responses.stream`` accumulates them, each with its
``sequence_number``:

    response.created, response.in_progress                the response, status in_progress, no output
    per output item, in order:
      a message:  response.output_item.added, response.content_part.added,
                  response.output_text.delta ..., response.output_text.done,
                  response.content_part.done, response.output_item.done
      reasoning:  response.output_item.added, response.reasoning_text.delta ...,
                  response.reasoning_text.done, response.output_item.done (with a reasoning parser on)
      a call:     response.output_item.added (arguments ""),
                  response.function_call_arguments.delta ..., response.function_call_arguments.done,
                  response.output_item.done
    response.completed | response.incomplete              the final response, usage included

The text comes in as the family's tool parser's events (llm_service/tools: content, a call's start,
its arguments in pieces; plain content when no calls are parsed). The non-streamed answer is built
by the same ``OutputItems`` with its events dropped, so the two cannot differ. A failure after the
200 went out is an ``error`` event, then ``response.failed``.
"""

from __future__ import annotations

import json
from typing import Any

from llm_service.tools.calls import ArgumentsDelta, CallStart, ContentDelta, ToolEvent
from llm_service.tools.reasoning import ReasoningDelta
from router.protocol.errors import APIError
from router.protocol.response_object import (
    OutputFunctionCall,
    OutputMessage,
    OutputReasoning,
    OutputTextPart,
    ReasoningTextPart,
    ResponseObject,
    function_call_id,
    message_id,
    reasoning_id,
)

Item = OutputReasoning | OutputMessage | OutputFunctionCall
_COMPACT = (",", ":")
_TEXT_TAIL = ',"logprobs":[]}'  # what a text delta carries after its text


class OutputItems:
    """One response's output items, built from parser events; ``render``: also its SSE events."""

    def __init__(self, render: bool = True) -> None:
        self.render = render
        self.sequence_number = 0
        self.items: list[Item] = []
        self._open: Item | None = None
        self._pieces: list[str] = []  # the open item's text or arguments so far, joined when it closes

    def event(self, kind: str, fields: dict[str, Any]) -> str:
        if not self.render:
            return ""
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=_COMPACT)}\n\n"

    def _delta(self, kind: str, item_id: str, text: str, content: str) -> str:
        """A text or arguments delta, rendered without a dict per token (``event``'s JSON, parsed)."""
        if not self.render:
            return ""
        n, self.sequence_number = self.sequence_number, self.sequence_number + 1
        return (
            f'event: {kind}\ndata: {{"type":"{kind}","sequence_number":{n},"item_id":"{item_id}",'
            f'"output_index":{len(self.items) - 1},{content}"delta":{json.dumps(text, ensure_ascii=False)}'
            f"{_TEXT_TAIL if content else '}'}\n\n"
        )

    def started(self, response: ResponseObject) -> str:
        started = response.model_dump()
        return self.event("response.created", {"response": started}) + self.event(
            "response.in_progress", {"response": started}
        )

    def feed(self, events: list[ToolEvent | ReasoningDelta]) -> str:
        out = []
        for e in events:
            if isinstance(e, ReasoningDelta):
                if not isinstance(self._open, OutputReasoning):
                    out.append(self._close("completed"))
                    item = OutputReasoning(id=reasoning_id(), status="in_progress", content=[])
                    out.append(self._add(item))
                self._pieces.append(e.text)
                out.append(
                    self._delta(
                        "response.reasoning_text.delta", self.items[-1].id, e.text, '"content_index":0,'
                    )
                )
            elif isinstance(e, ContentDelta):
                if not e.text:
                    continue
                message = self._open
                if not isinstance(message, OutputMessage):
                    out.append(self._open_message())
                    message = self._open
                    assert isinstance(message, OutputMessage)
                self._pieces.append(e.text)
                out.append(
                    self._delta("response.output_text.delta", message.id, e.text, '"content_index":0,')
                )
            elif isinstance(e, CallStart):
                out.append(self._close("completed"))
                call = OutputFunctionCall(
                    id=function_call_id(), call_id=e.id, name=e.name, arguments="", status="in_progress"
                )
                out.append(self._add(call))
            else:
                out.append(self._arguments(e))
        return "".join(out)

    def finished(self, response: ResponseObject) -> tuple[ResponseObject, str]:
        """The final response (its items closed with its status) and the stream's last events."""
        status = "incomplete" if response.status == "incomplete" else "completed"
        head = self._open_message() if not self.items else ""  # an empty answer: one empty message
        tail = self._close(status)
        final = response.model_copy(update={"output": list(self.items)})
        end = "response.completed" if final.status == "completed" else "response.incomplete"
        return final, head + tail + self.event(end, {"response": final.model_dump()})

    def failed(self, response: ResponseObject, error: APIError) -> str:
        """The stream's end when generating failed: what went wrong, then the failed response."""
        detail = error.body()["error"]
        self._settled()
        update = {"status": "failed", "error": {"code": error.code, "message": error.message}}
        failed = response.model_copy(update={**update, "output": list(self.items)})
        return self.event(
            "error", {"code": error.code, "message": detail["message"], "param": detail["param"]}
        ) + self.event("response.failed", {"response": failed.model_dump()})

    def _open_message(self) -> str:
        """A new message item after the open item (closed): the events that open it."""
        closed = self._close("completed")
        message = OutputMessage(id=message_id(), status="in_progress", content=[OutputTextPart(text="")])
        added = self._add(message)
        part = OutputTextPart(text="").model_dump()
        return closed + added + self.event("response.content_part.added", self._at(message, part=part))

    def _add(self, item: Item) -> str:
        self.items.append(item)
        self._open, self._pieces = item, []
        shown = item.model_copy(update={"content": []}) if isinstance(item, OutputMessage) else item
        return self.event(
            "response.output_item.added", {"output_index": len(self.items) - 1, "item": shown.model_dump()}
        )

    def _arguments(self, e: ArgumentsDelta) -> str:
        call = self._open
        assert isinstance(call, OutputFunctionCall), "arguments follow their call's start"
        self._pieces.append(e.text)
        return self._delta("response.function_call_arguments.delta", call.id, e.text, "")

    def _close(self, status: str) -> str:
        item = self._settled()
        self._open = None
        if item is None:
            return ""
        item.status = status  # type: ignore[assignment]
        index = len(self.items) - 1
        if isinstance(item, OutputMessage):
            part = item.content[0]
            done = self.event(
                "response.output_text.done", self._at(item, text=part.text, logprobs=[])
            ) + self.event("response.content_part.done", self._at(item, part=part.model_dump()))
        elif isinstance(item, OutputReasoning):
            done = self.event("response.reasoning_text.done", self._at(item, text=item.content[0].text))
        else:
            done = self.event(
                "response.function_call_arguments.done",
                {"item_id": item.id, "output_index": index, "name": item.name, "arguments": item.arguments},
            )
        return done + self.event(
            "response.output_item.done", {"output_index": index, "item": item.model_dump()}
        )

    def _settled(self) -> Item | None:
        """The open item with its text or arguments written in."""
        item = self._open
        if isinstance(item, OutputMessage):
            item.content[0].text = "".join(self._pieces)
        elif isinstance(item, OutputReasoning):
            item.content = [ReasoningTextPart(text="".join(self._pieces))]
        elif item is not None:
            item.arguments = "".join(self._pieces)
        return item

    def _at(self, item: OutputMessage | OutputReasoning, **fields: Any) -> dict[str, Any]:
        """A text event's place: the message (always the last item while it is open), its one part."""
        return {"item_id": item.id, "output_index": len(self.items) - 1, "content_index": 0, **fields}
