"""Gemma 4's calls, as its chat template writes them (``utils_gemma4`` in transformers parses them):

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

Keys are bare, strings sit between ``<|"|>`` quotes (no escapes inside), numbers, ``true``,
``false``, ``null``, ``{...}`` and ``[...]`` as in JSON. A call goes out whole when its end marker
(or the answer's end) comes: its arguments are converted to JSON then.
"""

from __future__ import annotations

import json
import re

from llm_service.tools.calls import ArgumentsDelta, CallStart, ToolEvent, new_call_id
from llm_service.tools.stream import MarkerStream

START, END = "<|tool_call>", "<tool_call|>"
QUOTE = '<|"|>'
_CALL = re.compile(r"\s*call:([\w.\-]+)(\{.*\})\s*\Z", re.DOTALL)
_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
_KEY = re.compile(r"[A-Za-z_][\w.\-]*")


class _Reader:
    """A recursive-descent reader of one Gemma 4 value (ValueError when it is not one)."""

    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def value(self) -> object:
        t, i = self.text, self.at
        if t.startswith(QUOTE, i):
            end = t.find(QUOTE, i + len(QUOTE))
            if end < 0:
                raise ValueError("unterminated string")
            self.at = end + len(QUOTE)
            return t[i + len(QUOTE) : end]
        if t.startswith("{", i):
            return self._object()
        if t.startswith("[", i):
            return self._array()
        for word, v in (("true", True), ("false", False), ("null", None)):
            if t.startswith(word, i):
                self.at = i + len(word)
                return v
        m = _NUMBER.match(t, i)
        if m is None or m.end() == i:
            raise ValueError(f"no value at {i}")
        self.at = m.end()
        return json.loads(m.group(0))

    def _object(self) -> dict[str, object]:
        self.at += 1
        out: dict[str, object] = {}
        while not self._eat("}"):
            if out and not self._eat(","):
                raise ValueError(f"',' expected at {self.at}")
            if self.text.startswith(QUOTE, self.at):
                key = self.value()
            else:
                m = _KEY.match(self.text, self.at)
                if m is None:
                    raise ValueError(f"a key expected at {self.at}")
                key, self.at = m.group(0), m.end()
            if not self._eat(":"):
                raise ValueError(f"':' expected at {self.at}")
            out[str(key)] = self.value()
        return out

    def _array(self) -> list[object]:
        self.at += 1
        out: list[object] = []
        while not self._eat("]"):
            if out and not self._eat(","):
                raise ValueError(f"',' expected at {self.at}")
            out.append(self.value())
        return out

    def _eat(self, s: str) -> bool:
        while self.at < len(self.text) and self.text[self.at] in " \n\t":
            self.at += 1
        if self.text.startswith(s, self.at):
            self.at += len(s)
            return True
        if self.at >= len(self.text):
            raise ValueError("unexpected end")
        return False


def gemma4_arguments(text: str) -> dict[str, object]:
    """``{key:value,...}`` in Gemma 4's syntax as a dict (ValueError if it is not one, whole)."""
    reader = _Reader(text)
    value = reader.value()
    if not isinstance(value, dict) or reader.at != len(text):
        raise ValueError("not one object")
    return value


class Gemma4Body:
    started = False  # a call goes out whole

    def __init__(self, index: int) -> None:
        self.index = index

    def partial(self, body: str) -> list[ToolEvent]:
        return []

    def complete(self, body: str) -> list[ToolEvent] | None:
        m = _CALL.match(body)
        if m is None:
            return None
        try:
            args = gemma4_arguments(m.group(2))
        except ValueError:
            return None
        text = json.dumps(args, ensure_ascii=False)
        return [CallStart(self.index, new_call_id(), m.group(1)), ArgumentsDelta(self.index, text)]


def gemma4_stream() -> MarkerStream:
    return MarkerStream(START, END, Gemma4Body)
