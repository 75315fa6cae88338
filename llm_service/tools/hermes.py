"""Hermes-style calls (Qwen2.5-VL, Qwen3-VL, Qwen3.5 templates):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``arguments`` streams as the model writes it, once ``{"name": "...", "arguments": `` has been read;
the object's closing brace and the whitespace around it are held back (they may close the call). A
body in another key order is a call too, its arguments re-serialised when the body is whole.
"""

from __future__ import annotations

import json
import re

from llm_service.tools.calls import ArgumentsDelta, CallStart, ToolEvent, new_call_id
from llm_service.tools.stream import MarkerStream

START, END = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _arguments_end(body: str, start: int) -> int:
    """Where the arguments that begin at ``start`` end: before the outer object's ``}`` and the
    blanks around it (scanned from the end: linear in that tail only)."""
    end = len(body)
    while end > start and body[end - 1].isspace():
        end -= 1
    if end > start and body[end - 1] == "}":
        end -= 1
        while end > start and body[end - 1].isspace():
            end -= 1
    return end


class HermesBody:
    def __init__(self, index: int) -> None:
        self.index = index
        self._args_at = -1  # where the arguments begin in the body, once the header is read
        self._sent = 0  # arguments characters sent

    @property
    def started(self) -> bool:
        return self._args_at >= 0

    def partial(self, body: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        if self._args_at < 0:
            m = _HEADER.match(body)
            if m is None or m.end() == len(body):  # blanks may still follow the colon
                return events
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                return events
            events.append(CallStart(self.index, new_call_id(), name))
            self._args_at = m.end()
        end = _arguments_end(body, self._args_at)
        if end - self._args_at > self._sent:
            events.append(ArgumentsDelta(self.index, body[self._args_at + self._sent : end]))
            self._sent = end - self._args_at
        return events

    def complete(self, body: str) -> list[ToolEvent] | None:
        events = self.partial(body)
        if self.started:
            return events
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        args = call.get("arguments", call.get("parameters", {}))
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return [CallStart(self.index, new_call_id(), call["name"]), ArgumentsDelta(self.index, text)]


def hermes_stream() -> MarkerStream:
    return MarkerStream(START, END, HermesBody)
