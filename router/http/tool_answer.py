"""The answer's tool calls (docs/tools.md, "Tool calls in the answer"): the family's parser over the
answer's text, non-streamed (``message.tool_calls``) and streamed (OpenAI's deltas: a call's
``index``, ``id``, ``type`` and ``function.name`` first with ``arguments`` "", then ``arguments`` in
pieces). ``finish_reason`` is ``tool_calls`` when calls were parsed and the model stopped by itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from llm_service.outputs import RequestOutput
from llm_service.tools.calls import CallStart, ContentDelta, ToolEvent
from llm_service.tools.formats import ToolFormat
from router.http.choices import ChoiceState
from router.http.sse import ChunkRenderer
from router.protocol.chat_output import AssistantMessage, ChoiceLogprobs, MessageToolCall, ToolCallFunction


def answer_decoder(
    orch: Any, fmt: ToolFormat | None, more_markers: Sequence[str] = ()
) -> Callable[[Sequence[int]], str]:
    """How the answer's tokens become text: ``orch.decode`` (special tokens skipped), unless the
    tool format's markers (or ``more_markers``: the reasoning parser's) are special tokens of
    ``orch.tokenizer`` (Gemma 4's ``<|tool_call>``, ``<|channel>``): then every special token but those
    is dropped and the rest decoded as it is, markers included."""
    decode: Callable[[Sequence[int]], str] = orch.decode
    markers = (*(fmt.markers if fmt is not None else ()), *more_markers)
    if not markers:
        return decode
    tokenizer = orch.tokenizer
    added = tokenizer.get_added_vocab()
    kept = {added[m] for m in markers if m in added}
    special = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if t.special
    }
    if not kept & special:
        return decode
    drop = special - kept

    def keeping_markers(token_ids: Sequence[int]) -> str:
        return str(tokenizer.decode([t for t in token_ids if t not in drop], skip_special_tokens=False))

    return keeping_markers


def tool_finish(finish: str | None, called: bool) -> str | None:
    return "tool_calls" if called and finish == "stop" else finish


def tool_message(fmt: ToolFormat, text: str, finish: str | None) -> tuple[AssistantMessage, str | None]:
    """The non-streamed message of ``text`` and its finish reason."""
    out = fmt.parse(text)
    calls = [
        MessageToolCall(id=c.id, function=ToolCallFunction(name=c.name, arguments=c.arguments))
        for c in out.calls
    ]
    return AssistantMessage(content=out.content, tool_calls=calls or None), tool_finish(finish, bool(calls))


def _delta_json(e: ToolEvent) -> str:
    if isinstance(e, ContentDelta):
        return json.dumps({"content": e.text}, ensure_ascii=False)
    if isinstance(e, CallStart):
        fn = {"name": e.name, "arguments": ""}
        call = {"index": e.index, "id": e.id, "type": "function", "function": fn}
    else:
        call = {"index": e.index, "function": {"arguments": e.text}}
    return json.dumps({"tool_calls": [call]}, ensure_ascii=False)


class ToolDeltas:
    """One streamed choice's text -> its SSE events, parsed for calls as it comes."""

    def __init__(self, fmt: ToolFormat, renderer: ChunkRenderer) -> None:
        self.stream, self.renderer = fmt.stream(), renderer
        self.called = False

    def events(self, text: str, finish: str | None, logprobs: str = "") -> str:
        """The events of ``text`` (``finish``: the answer's last; ``logprobs``: its rendered
        ``"logprobs": {...}`` member, carried by the first event)."""
        parsed = self.stream.feed(text) + (self.stream.finish() if finish else [])
        self.called = self.called or any(isinstance(e, CallStart) for e in parsed)
        deltas = [_delta_json(e) for e in parsed]
        if finish:
            deltas.append("{}")
        if logprobs and not deltas:
            deltas.append('{"content":""}')
        out = []
        for i, d in enumerate(deltas):
            last = finish is not None and i == len(deltas) - 1
            out.append(
                self.renderer.raw(
                    d, tool_finish(finish, self.called) if last else None, logprobs if i == 0 else ""
                )
            )
        return "".join(out)


class ToolChoiceEvents:
    """``n`` > 1 with tools: each choice's events through its own ``ToolDeltas`` (a ``ChoiceEvents``)."""

    def __init__(
        self,
        fmt: ToolFormat,
        request_id: str,
        model: str,
        states: list[ChoiceState],
        logprobs: Callable[[RequestOutput], ChoiceLogprobs | None],
    ) -> None:
        self.renderers = [ChunkRenderer(request_id, model, index=s.index) for s in states]
        self.deltas = [ToolDeltas(fmt, r) for r in self.renderers]
        self.sent = [0] * len(states)

    def opening(self, state: ChoiceState) -> str:
        return self.renderers[state.index].role()

    def delta(self, state: ChoiceState, text: str, out: RequestOutput) -> str:
        lp = ""
        new = state.logprobs[self.sent[state.index] :]
        if out.new_logprobs and new:
            self.sent[state.index] = len(state.logprobs)
            lp = ChoiceLogprobs(content=new).model_dump_json()
        return self.deltas[state.index].events(text, state.finish, lp)
