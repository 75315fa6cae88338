"""Gemma 4's calls, as its chat template writes them (``utils_gemma4`` in transformers parses them):

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

Keys are bare, strings sit between ``<|"|>`` quotes (no escapes inside), numbers, ``true``,
``false``, ``null``, ``{...}`` and ``[...]`` as in JSON.

Streamed as JSON built as the arguments arrive: ``{`` when the call starts (once its first value begins
as a value can, or at ``{}``: ``call:f{a:}`` is no call), then per top-level argument ``"key": value``;
a string value streams as its characters come (a cut ``<|"|>`` held back), any other value goes out
whole once the text after it shows it ended. The text equals ``json.dumps`` of the arguments. A call cut
by the answer's end, or broken after it started, closes what it has.
"""

from __future__ import annotations

import json
import re

from llm_service.tools.calls import ArgumentsDelta, CallStart, ToolEvent, new_call_id
from llm_service.tools.stream import MarkerStream, held_back

START, END = "<|tool_call>", "<tool_call|>"
QUOTE = '<|"|>'
_HEADER = re.compile(r"\s*call:([\w.\-]+)\{")
_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
_NUMBER_SO_FAR = re.compile(r"-?(0|[1-9]\d*)?(\.\d*)?([eE][+-]?\d*)?\Z")  # the text may end in a number
_KEY = re.compile(r"[A-Za-z_][\w.\-]*")


class _Incomplete(ValueError):
    """The text ends before the value does (it may still become one)."""


class _Reader:
    """A recursive-descent reader of one Gemma 4 value (ValueError when it is not one; ``_Incomplete``
    when the text ends first)."""

    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def value(self) -> object:
        t, i = self.text, self.at
        if (
            i >= len(t)
            or any(w.startswith(t[i:]) for w in (QUOTE, "true", "false", "null"))
            or _NUMBER_SO_FAR.match(t, i)
        ):
            raise _Incomplete("unexpected end")
        if t.startswith(QUOTE, i):
            end = t.find(QUOTE, i + len(QUOTE))
            if end < 0:
                raise _Incomplete("unterminated string")
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
            if self.text.startswith(QUOTE, self.at) or QUOTE.startswith(self.text[self.at :]):
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
            raise _Incomplete("unexpected end")
        return False


def gemma4_arguments(text: str) -> dict[str, object]:
    """``{key:value,...}`` in Gemma 4's syntax as a dict (ValueError if it is not one, whole)."""
    reader = _Reader(text)
    value = reader.value()
    if not isinstance(value, dict) or reader.at != len(text):
        raise ValueError("not one object")
    return value


_WAIT = None  # the text so far cannot tell yet


def _skip_blanks(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \n\t":
        at += 1
    return at


def _key_at(text: str, at: int) -> tuple[str, int] | None:
    """The key at ``at`` and where its value begins (past ``:`` and blanks); None: wait for more text.
    ValueError: no key is there."""
    reader = _Reader(text)
    reader.at = at
    if text.startswith(QUOTE, at) or QUOTE.startswith(text[at:]):
        key = str(reader.value())
    else:
        m = _KEY.match(text, at)
        if m is None:
            raise ValueError(f"a key expected at {at}")
        key, reader.at = m.group(0), m.end()
    if not reader._eat(":"):
        raise ValueError(f"':' expected at {reader.at}")
    at = _skip_blanks(text, reader.at)
    return (key, at) if at < len(text) else _WAIT


class Gemma4Body:
    def __init__(self, index: int) -> None:
        self.index = index
        self._at = -1  # where reading goes on in the body, once the call has started
        self._count = 0  # arguments begun
        self._string_at = -1  # where the open string value's text begins
        self._sent = 0  # its characters sent
        self._scan = 0  # where its closing quote may begin
        self._done = False  # the top-level ``}`` read, or the body broke: the rest is ignored

    @property
    def started(self) -> bool:
        return self._at >= 0

    def partial(self, body: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        if not self.started and not self._start(body, events):
            return events
        while not self._done:
            if self._string_at >= 0:
                end = body.find(QUOTE, max(self._string_at, self._scan))
                if end < 0:
                    self._scan = max(0, len(body) - len(QUOTE) + 1)  # searched once per character
                    self._send(body, len(body) - held_back(body, QUOTE), events)
                    return events
                self._send(body, end, events)
                events.append(ArgumentsDelta(self.index, '"'))
                self._string_at, self._at = -1, end + len(QUOTE)
            elif not self._next(body, events):
                return events
        return events

    def complete(self, body: str) -> list[ToolEvent] | None:
        events = self.partial(body)
        if not self.started:
            return None
        if self._string_at >= 0:  # cut inside a string: close it
            self._send(body, len(body), events)
            events.append(ArgumentsDelta(self.index, '"'))
        events.append(ArgumentsDelta(self.index, "}"))
        return events

    def _start(self, body: str, events: list[ToolEvent]) -> bool:
        m = _HEADER.match(body)
        if m is None:
            return False
        at = _skip_blanks(body, m.end())
        if at == len(body):
            return False
        if body[at] != "}":
            try:
                found = _key_at(body, at)
            except ValueError:
                return False
            if found is None or not self._value_may_start(body[found[1] :]):
                return False
        self._at = m.end()
        events += [CallStart(self.index, new_call_id(), m.group(1)), ArgumentsDelta(self.index, "{")]
        return True

    @staticmethod
    def _value_may_start(text: str) -> bool:
        return text.startswith(QUOTE) or QUOTE.startswith(text) or text[0] in "-0123456789{[tfn"

    def _next(self, body: str, events: list[ToolEvent]) -> bool:
        """Read the next top-level argument; False: wait for more text (or the body is done)."""
        at = _skip_blanks(body, self._at)
        if at == len(body):
            return False
        if body[at] == "}" or (self._count and body[at] != ","):  # the end, or broken
            self._done = True
            return False
        if self._count:
            at = _skip_blanks(body, at + 1)
        try:
            found = _key_at(body, at)
        except _Incomplete:
            return False
        except ValueError:
            self._done = True
            return False
        if found is None:
            return False
        key, at = found
        head = ("" if self._count == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": "
        if body.startswith(QUOTE, at):
            events.append(ArgumentsDelta(self.index, head + '"'))
            self._count += 1
            self._string_at, self._sent = at + len(QUOTE), 0
            return True
        reader = _Reader(body)
        reader.at = at
        try:
            value = reader.value()
        except _Incomplete:
            return False
        except ValueError:
            self._done = True
            return False
        if _skip_blanks(body, reader.at) == len(body):  # a number may go on
            return False
        events.append(ArgumentsDelta(self.index, head + json.dumps(value, ensure_ascii=False)))
        self._count += 1
        self._at = reader.at
        return True

    def _send(self, body: str, stop: int, events: list[ToolEvent]) -> None:
        """Send the open string's characters up to ``stop`` not yet sent."""
        begin = self._string_at + self._sent
        if stop > begin:
            events.append(ArgumentsDelta(self.index, json.dumps(body[begin:stop], ensure_ascii=False)[1:-1]))
            self._sent += stop - begin


def gemma4_stream() -> MarkerStream:
    return MarkerStream(START, END, Gemma4Body)
