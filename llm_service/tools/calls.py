"""A parsed answer's tool calls, and the events an incremental parser emits.

The streamed events reassemble to the non-streamed answer by construction: ``parse`` feeds the whole
text to the same incremental parser and ``collect``s its events.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field


def new_call_id() -> str:
    """OpenAI's shape: ``call_`` and 24 random alphanumerics."""
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return "call_" + "".join(secrets.choice(alphabet) for _ in range(24))


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments as the model wrote them, as a JSON text


@dataclass
class ParsedOutput:
    content: str | None  # the text outside the calls; None when it is only whitespace and calls were made
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    """The first event of a call: OpenAI's first delta of ``tool_calls[index]`` (arguments "")."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


ToolEvent = ContentDelta | CallStart | ArgumentsDelta


def collect(events: list[ToolEvent]) -> ParsedOutput:
    """The message the events make: content joined, each call's arguments joined."""
    content: list[str] = []
    calls: list[ToolCall] = []
    for e in events:
        if isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, CallStart):
            assert e.index == len(calls), "calls start in index order"
            calls.append(ToolCall(e.id, e.name, ""))
        else:
            calls[e.index].arguments += e.text
    text = "".join(content)
    return ParsedOutput(text if text.strip() or not calls else None, calls)
