"""``MarkerStream``: the incremental parser of a format that wraps each call in a start and an end
marker (hermes, Gemma 4). Fed text deltas, it emits content, a call's start, its arguments in pieces.

    text ... <start> body <end> text ... <start> body <end> ...
    ^ content         ^ a CallBody: header, then arguments

Never emits a partial marker as text: a tail that could begin a marker waits for the next delta.
Whitespace waits for the text after it: before a call it is dropped (the blank lines between calls
are no content), at the end it goes out only if no call was made.
A body that is no call (its format says so) goes out as content, markers included; a body the answer's
end cuts before it can be read as a call (``max_tokens`` inside a second call) is dropped, not sent as text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from llm_service.tools.calls import ContentDelta, ParsedOutput, ToolEvent, collect


class CallBody(Protocol):
    """One call's text between the markers, as it grows (``index``: the call's place in the answer)."""

    def partial(self, body: str) -> list[ToolEvent]:
        """Events the body so far already settles (a header, arguments that cannot change)."""
        ...

    def complete(self, body: str) -> list[ToolEvent] | None:
        """The rest of the call's events once its body is whole; None: the body is no call."""
        ...

    @property
    def started(self) -> bool:
        """Whether a ``CallStart`` went out (then the body is a call whatever follows)."""
        ...


def held_back(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    at = text.find(marker[0], max(0, len(text) - len(marker) + 1))
    while at >= 0:
        if marker.startswith(text[at:]):
            return len(text) - at
        at = text.find(marker[0], at + 1)
    return 0


class MarkerStream:
    def __init__(self, start: str, end: str, new_body: Callable[[int], CallBody]) -> None:
        self.start, self.end, self.new_body = start, end, new_body
        self._buf = ""  # text not yet settled: outside, a possible marker's start; inside, the body
        self._body: CallBody | None = None
        self._calls = 0
        self._blank = ""  # whitespace held until the text after it
        self._before = ""  # the whitespace held when the current body began
        self._scan = 0  # where in the body the end marker may begin (searched once per character)

    def feed(self, text: str) -> list[ToolEvent]:
        self._buf += text
        events: list[ToolEvent] = []
        while True:
            if self._body is None:
                at = self._buf.find(self.start)
                if at < 0:
                    keep = held_back(self._buf, self.start)
                    self._content(self._buf[: len(self._buf) - keep], events)
                    self._buf = self._buf[len(self._buf) - keep :]
                    return events
                self._content(self._buf[:at], events)
                self._buf = self._buf[at + len(self.start) :]
                self._body = self.new_body(self._calls)
                self._before, self._blank = self._blank, ""  # dropped if the body is a call
                self._scan = 0
            else:
                at = self._buf.find(self.end, self._scan)
                if at < 0:
                    self._scan = max(0, len(self._buf) - len(self.end) + 1)
                    keep = held_back(self._buf, self.end)
                    events += self._body.partial(self._buf[: len(self._buf) - keep])
                    return events
                self._close(self._buf[:at], self.start + self._buf[: at + len(self.end)], events)
                self._buf = self._buf[at + len(self.end) :]

    def finish(self) -> list[ToolEvent]:
        """The end of the answer: what was held goes out; an unterminated call is closed if it can be,
        else dropped (a call cut by ``max_tokens`` is no text the model meant to say)."""
        events: list[ToolEvent] = []
        if self._body is None:
            self._content(self._buf, events)
        else:  # the answer ended inside a call (max_tokens): a cut end marker is no part of its body
            done = self._body.complete(self._buf[: len(self._buf) - held_back(self._buf, self.end)])
            if done is not None:
                events += done
                self._calls += 1
            # else the body was cut before it could be read as a call: none of it goes out as text
            self._body = None
        if self._blank and not self._calls:
            events.append(ContentDelta(self._blank))
        self._buf = self._blank = ""
        return events

    def _close(self, body: str, raw: str, events: list[ToolEvent]) -> None:
        assert self._body is not None
        done = self._body.complete(body)
        if done is None:
            assert not self._body.started, "a started call completes"
            self._content(self._before + raw, events)
        else:
            events += done
            self._calls += 1
        self._body = None

    def _content(self, text: str, events: list[ToolEvent]) -> None:
        said = text.rstrip()
        if not said:
            self._blank += text
            return
        events.append(ContentDelta(self._blank + said))
        self._blank = text[len(said) :]


class StreamParser(Protocol):
    def feed(self, text: str) -> list[ToolEvent]: ...

    def finish(self) -> list[ToolEvent]: ...


def parse_whole(stream: StreamParser, text: str) -> ParsedOutput:
    """The non-streamed answer: the whole text through the incremental parser."""
    return collect(stream.feed(text) + stream.finish())
