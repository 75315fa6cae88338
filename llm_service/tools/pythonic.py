"""Pythonic calls (Gemma 3: its template has no tool format of its own; vLLM serves it with
``--tool-call-parser pythonic`` and a template that asks for this one):

    [get_weather(city="Paris", days=3), get_time(zone="CET")]

The whole answer is the list, or it is content: an answer whose first non-blank character is ``[``
is held until its end and parsed as a Python list of calls with literal keyword arguments; any
other answer streams as content.
"""

from __future__ import annotations

import ast
import json

from llm_service.tools.calls import ArgumentsDelta, CallStart, ContentDelta, ToolEvent, new_call_id


def pythonic_calls(text: str) -> list[tuple[str, dict[str, object]]] | None:
    """``[f(a=1), g()]`` as (name, arguments) pairs, or None when ``text`` is not such a list."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _dotted(node.func)
        if name is None:
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            json.dumps(args)
        except (ValueError, TypeError, SyntaxError):
            return None
        if len(args) != len(node.keywords):
            return None  # a **kwargs
        calls.append((name, args))
    return calls


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value)) is not None:
        return f"{base}.{node.attr}"
    return None


class PythonicStream:
    def __init__(self) -> None:
        self._buf = ""
        self._mode = ""  # "": blank so far; "list": held to the end; "text": content

    def feed(self, text: str) -> list[ToolEvent]:
        if self._mode == "text":
            return [ContentDelta(text)] if text else []
        self._buf += text
        if self._mode == "" and self._buf.strip():
            self._mode = "list" if self._buf.lstrip().startswith("[") else "text"
            if self._mode == "text":
                out, self._buf = self._buf, ""
                return [ContentDelta(out)]
        return []

    def finish(self) -> list[ToolEvent]:
        if self._mode != "list":
            return []
        calls = pythonic_calls(self._buf)
        if calls is None:
            return [ContentDelta(self._buf)]
        events: list[ToolEvent] = []
        for i, (name, args) in enumerate(calls):
            events += [
                CallStart(i, new_call_id(), name),
                ArgumentsDelta(i, json.dumps(args, ensure_ascii=False)),
            ]
        return events


def pythonic_stream() -> PythonicStream:
    return PythonicStream()
