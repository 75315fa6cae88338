"""Qwen3.5's calls, as its chat template writes them (vLLM parses them with ``qwen3_coder``):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text: a string as it is when the function's schema types it as a string,
otherwise read as JSON (a string when it is not JSON).

Streamed as JSON built as the parameters arrive: ``{`` when the call starts (at its first parameter, or
at ``</function>``: a header followed by other text is no call), then per parameter ``"key": value``; a
string-typed value streams as its characters come (the newline before ``</parameter>`` held back), any
other value goes out whole when its ``</parameter>`` comes (it may still turn out not to be JSON). The
text equals ``json.dumps`` of the arguments. A call cut by the answer's end closes what it has: an open
string value as far as it goes, an unfinished other value dropped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from llm_service.tools.calls import ArgumentsDelta, CallStart, ToolEvent, new_call_id
from llm_service.tools.stream import MarkerStream, held_back

START, END = "<tool_call>", "</tool_call>"
PARAM_END, FUNCTION_END = "</parameter>", "</function>"
_HEADER = re.compile(r"\s*<function=([^>\n]+)>\s*")
_PARAM = re.compile(r"<parameter=([^>\n]+)>")
_PARTIAL_PARAM = re.compile(r"<(p(a(r(a(m(e(t(e(r(=[^>\n]*)?)?)?)?)?)?)?)?)?)?\Z")


def is_string_schema(schema: object) -> bool:
    """Whether a parameter's value is written as raw text: its schema types it as a string only."""
    if not isinstance(schema, dict):
        return False
    if schema.get("type") == "string":
        return True
    options = schema.get("enum", [schema["const"]] if "const" in schema else [])
    return (
        "type" not in schema
        and isinstance(options, list)
        and bool(options)
        and all(isinstance(o, str) for o in options)
    )


def _value(text: str, schema: object) -> object:
    text = text.removeprefix("\n").removesuffix("\n")
    if is_string_schema(schema):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _tag_may_follow(rest: str) -> bool:
    """``rest`` (text from a ``<``) may still grow into a parameter tag or ``</function>``."""
    return FUNCTION_END.startswith(rest) or _PARTIAL_PARAM.match(rest) is not None


class Qwen3XMLBody:
    def __init__(self, index: int, schemas: Mapping[str, Any]) -> None:
        self.index, self.schemas = index, schemas
        self._name = ""
        self._params: Mapping[str, Any] = {}
        self._at = -1  # where in the body reading goes on, once the call has started
        self._count = 0  # parameters begun
        self._key: str | None = None  # the parameter being read
        self._value_at = 0  # where its value begins in the body
        self._sent = 0  # characters of a string value sent
        self._scan = 0  # where ``</parameter>`` may begin
        self._head = ""  # a non-string value's ``"key": `` (and separator): it goes out with the value
        self._done = False  # ``</function>`` read: the rest of the body is ignored

    @property
    def started(self) -> bool:
        return self._at >= 0

    def partial(self, body: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        if not self.started and not self._start(body, events):
            return events
        while not self._done:
            if self._key is not None:
                if not self._read_value(body, events):
                    return events
                continue
            at = body.find("<", self._at)
            if at < 0:
                self._at = len(body)  # stray text between parameters: skipped
                return events
            rest = body[at:]
            m = _PARAM.match(body, at)
            if m is not None:
                self._begin_param(m.group(1), m.end(), events)
            elif rest.startswith(FUNCTION_END):
                self._done = True
            elif _tag_may_follow(rest):
                self._at = at
                return events
            else:
                self._at = at + 1
        return events

    def complete(self, body: str) -> list[ToolEvent] | None:
        events = self.partial(body)
        if not self.started:
            return None
        if self._key is not None and self._is_string:  # cut inside a string value: close it
            self._send_string(body, len(body), events)
            events.append(ArgumentsDelta(self.index, '"'))
        events.append(ArgumentsDelta(self.index, "}"))
        return events

    def _start(self, body: str, events: list[ToolEvent]) -> bool:
        """A header then a parameter tag or ``</function>`` (only blanks between) start the call."""
        m = _HEADER.match(body)
        if m is None or m.end() == len(body):
            return False
        rest = body[m.end() :]
        if not (_PARAM.match(rest) or rest.startswith(FUNCTION_END)):
            return False
        self._name, self._at = m.group(1), m.end()
        self._params = (self.schemas.get(self._name) or {}).get("properties") or {}
        events += [CallStart(self.index, new_call_id(), self._name), ArgumentsDelta(self.index, "{")]
        return True

    @property
    def _is_string(self) -> bool:
        return is_string_schema(self._params.get(self._key or ""))

    def _begin_param(self, key: str, value_at: int, events: list[ToolEvent]) -> None:
        head = ("" if self._count == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": "
        self._key, self._value_at, self._sent = key, value_at, 0
        self._count += 1
        if self._is_string:
            events.append(ArgumentsDelta(self.index, head + '"'))
        else:
            self._head = head

    def _read_value(self, body: str, events: list[ToolEvent]) -> bool:
        """Read the open parameter's value; True once its ``</parameter>`` has been read."""
        end = body.find(PARAM_END, max(self._value_at, self._scan))
        if end < 0:
            self._scan = max(0, len(body) - len(PARAM_END) + 1)  # searched once per character
            if self._is_string:
                self._send_string(body, len(body) - held_back(body, PARAM_END), events)
            return False
        if self._is_string:
            self._send_string(body, end, events)
            events.append(ArgumentsDelta(self.index, '"'))
        else:
            text = body[self._value_at : end]
            value = json.dumps(_value(text, self._params.get(self._key or "")), ensure_ascii=False)
            events.append(ArgumentsDelta(self.index, self._head + value))
        self._key, self._at = None, end + len(PARAM_END)
        return True

    def _send_string(self, body: str, stop: int, events: list[ToolEvent]) -> None:
        """Send the open value's characters up to ``stop`` not yet sent: the newline after the tag and
        a last newline are none of them (that one may be the newline before ``</parameter>``, else
        it goes out with the text after it)."""
        start = self._value_at
        if stop > start and body[start] == "\n":
            start += 1
        if stop > start and body[stop - 1] == "\n":
            stop -= 1
        begin = start + self._sent
        if stop > begin:
            events.append(ArgumentsDelta(self.index, json.dumps(body[begin:stop], ensure_ascii=False)[1:-1]))
            self._sent += stop - begin


def qwen3_xml_stream(schemas: Mapping[str, Any]) -> MarkerStream:
    """``schemas``: each function's parameters schema by name (how its values are read)."""
    return MarkerStream(START, END, lambda i: Qwen3XMLBody(i, schemas))
