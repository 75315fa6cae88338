"""Reasoning ("thinking") out of the model's answer (pure): the text between a family's thinking markers
goes to vLLM's ``reasoning`` field, the rest to ``content`` (where the tool parser reads its calls).

vLLM 0.32's parsers, by the same names: ``qwen3`` (Qwen3.5's template opens ``<think>`` in the
generation prompt, so the answer starts inside the reasoning and ``</think>`` ends it; a leading
``<think>`` the model writes itself is dropped; ``<tool_call>`` before ``</think>`` ends it too, the
marker kept for the tool parser; with ``enable_thinking`` false the whole answer is content) and
``gemma4`` (``<|channel>thought\\n ... <channel|>``, the ``thought\\n`` label dropped; an answer without
the channel is all content). An answer cut before the end marker is all reasoning.

The stream never sends a part of a marker as text: a tail that may still grow into one is held until
the next text says (``ReasoningStream.feed``); ``finish`` lets it go as what it turned out to be.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum


class Lane(Enum):
    REASONING = "reasoning"
    CONTENT = "content"


@dataclass(frozen=True)
class ReasoningDelta:
    """A piece of the reasoning, beside the tool parser's events (``llm_service.tools.calls``)."""

    text: str


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str  # the marker that opens the reasoning
    end: str  # the marker that closes it
    label: str = ""  # dropped right after ``start`` (Gemma 4's channel name)
    opens_inside: bool = False  # the generation prompt opened the reasoning (Qwen3.5, thinking on)
    implicit_end: str | None = None  # a marker that ends the reasoning and stays in the content

    def stream(self, template_kwargs: Mapping[str, object] | None = None) -> ReasoningStream:
        """A fresh parser for one answer to a prompt rendered with ``template_kwargs``."""
        thinking = (template_kwargs or {}).get("enable_thinking", True) is not False
        return ReasoningStream(self, inside=self.opens_inside and thinking)

    def parse(
        self, text: str, template_kwargs: Mapping[str, object] | None = None
    ) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole answer, each None when empty (vLLM's non-streamed fields)."""
        s = self.stream(template_kwargs)
        parts = s.feed(text) + s.finish()
        reasoning = "".join(t for lane, t in parts if lane is Lane.REASONING)
        content = "".join(t for lane, t in parts if lane is Lane.CONTENT)
        return reasoning or None, content or None

    @property
    def markers(self) -> tuple[str, ...]:
        """The marker texts the answer's decoding must keep (special tokens or not)."""
        return tuple(m for m in (self.start, self.end, self.implicit_end) if m)


class _State(Enum):
    AWAIT_START = 0  # content, until ``start`` opens the reasoning
    LABEL = 1  # right after the reasoning opened: the label (or a leading ``start``) may follow
    REASONING = 2
    CONTENT = 3  # after the reasoning: content to the end


class ReasoningStream:
    """One answer's text, fed in pieces, split into ``(Lane, text)`` parts. The parts' texts joined per
    lane are the same whatever the pieces were (tests/unit/llm_service/tools/test_reasoning.py)."""

    def __init__(self, fmt: ReasoningFormat, *, inside: bool) -> None:
        self.fmt = fmt
        self.state = _State.LABEL if inside else _State.AWAIT_START
        self.label = fmt.start if inside else fmt.label  # what LABEL drops when it comes first
        self.held = ""
        self.reasoning_chars = 0

    def feed(self, text: str) -> list[tuple[Lane, str]]:
        self.held += text
        out: list[tuple[Lane, str]] = []
        while self.held and self._step(out):
            pass
        return [(lane, t) for lane, t in out if t]

    def finish(self) -> list[tuple[Lane, str]]:
        """What is held at the end of the answer, as the lane it is in."""
        rest, self.held = self.held, ""
        if not rest:
            return []
        lane = Lane.CONTENT if self.state in (_State.AWAIT_START, _State.CONTENT) else Lane.REASONING
        return [(lane, rest)]

    @property
    def in_reasoning(self) -> bool:
        return self.state in (_State.LABEL, _State.REASONING)

    def _step(self, out: list[tuple[Lane, str]]) -> bool:
        """One move on ``self.held``; False when the rest must wait for more text."""
        if self.state is _State.CONTENT:
            out.append((Lane.CONTENT, self.held))
            self.held = ""
            return False
        if self.state is _State.LABEL:
            if self.label and self.held.startswith(self.label):
                self.held = self.held[len(self.label) :]
            elif self.label.startswith(self.held):
                return False  # may still become the label
            self.state = _State.REASONING
            return True
        if self.state is _State.AWAIT_START:
            return self._until(out, Lane.CONTENT, {self.fmt.start: (_State.LABEL, False)})
        ends = {self.fmt.end: (_State.CONTENT, False)}
        if self.fmt.implicit_end:
            ends[self.fmt.implicit_end] = (_State.CONTENT, True)
        return self._until(out, Lane.REASONING, ends)

    def _until(
        self, out: list[tuple[Lane, str]], lane: Lane, markers: dict[str, tuple[_State, bool]]
    ) -> bool:
        """Text in ``lane`` up to the first of ``markers`` (then its state; True: the marker is kept in
        the next lane's text), or up to a tail that may still grow into one of them."""
        found = [(i, m) for m in markers if (i := self.held.find(m)) >= 0]
        if found:
            i, marker = min(found)
            self._emit(out, lane, self.held[:i])
            state, keep = markers[marker]
            self.held = self.held[i if keep else i + len(marker) :]
            self.state = state
            if state is _State.LABEL:
                self.label = self.fmt.label
            return True
        cut = len(self.held) - _partial_tail(self.held, markers)
        self._emit(out, lane, self.held[:cut])
        self.held = self.held[cut:]
        return False

    def _emit(self, out: list[tuple[Lane, str]], lane: Lane, text: str) -> None:
        if lane is Lane.REASONING:
            self.reasoning_chars += len(text)
        out.append((lane, text))


def _partial_tail(text: str, markers: Mapping[str, object]) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat("qwen3", "<think>", "</think>", opens_inside=True, implicit_end="<tool_call>"),
    "gemma4": ReasoningFormat("gemma4", "<|channel>", "<channel|>", label="thought\n"),
}


def reasoning_format(name: str) -> ReasoningFormat:
    fmt = REASONING_FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"reasoning parser {name!r} is unknown; known: {', '.join(REASONING_FORMATS)}")
    return fmt
