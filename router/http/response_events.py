"""A streamed response's server-sent events, in the order the ``openai`` SDK's
``client.responses.stream`` accumulates them, each with its ``sequence_number``:

    response.created, response.in_progress           the response, status in_progress, no output
    response.output_item.added                       the message item, content []   (output_index 0)
    response.content_part.added                      an empty output_text part      (content_index 0)
    response.output_text.delta ...                   the text, piece by piece
    response.output_text.done                        the whole text
    response.content_part.done, response.output_item.done
    response.completed | response.incomplete         the final response, usage included

A failure after the 200 went out is an ``error`` event, then ``response.failed``. Each event is an
``event:`` line and a ``data:`` line; the body ends with ``data: [DONE]`` (the SDK stops there, and
the ingress's admission ticket is released with it, router/http/lifecycle.py).
"""

from __future__ import annotations

import json
from typing import Any

from router.protocol.errors import APIError
from router.protocol.responses import OutputMessage, OutputTextPart, ResponseObject


class ResponseEvents:
    """The events of one streamed response, numbered in the order they are rendered."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def event(self, kind: str, fields: dict[str, Any]) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def head(self, response: ResponseObject, item: OutputMessage) -> str:
        """From ``response.created`` to the empty text part, one write."""
        started = response.model_dump()
        added = item.model_copy(update={"content": []}).model_dump()
        return (
            self.event("response.created", {"response": started})
            + self.event("response.in_progress", {"response": started})
            + self.event("response.output_item.added", {"output_index": 0, "item": added})
            + self.event(
                "response.content_part.added", self._at(item, part=OutputTextPart(text="").model_dump())
            )
        )

    def delta(self, item: OutputMessage, text: str) -> str:
        return self.event("response.output_text.delta", self._at(item, delta=text, logprobs=[]))

    def tail(self, response: ResponseObject) -> str:
        """From ``response.output_text.done`` to ``response.completed`` (or ``.incomplete``)."""
        item = response.output[0]
        part = item.content[0]
        end = "response.completed" if response.status == "completed" else "response.incomplete"
        return (
            self.event("response.output_text.done", self._at(item, text=part.text, logprobs=[]))
            + self.event("response.content_part.done", self._at(item, part=part.model_dump()))
            + self.event("response.output_item.done", {"output_index": 0, "item": item.model_dump()})
            + self.event(end, {"response": response.model_dump()})
        )

    def failed(self, response: ResponseObject, error: APIError) -> str:
        """The stream's end when generating failed: what went wrong, then the failed response."""
        detail = error.body()["error"]
        failed = response.model_copy(
            update={"status": "failed", "error": {"code": error.code, "message": error.message}}
        )
        return self.event(
            "error", {"code": error.code, "message": detail["message"], "param": detail["param"]}
        ) + self.event("response.failed", {"response": failed.model_dump()})

    @staticmethod
    def _at(item: OutputMessage, **fields: Any) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": 0, "content_index": 0, **fields}
