"""``n`` > 1: several answers to one prompt. The first choice is submitted alone; once its first token
is out (the prompt's KV blocks are in its replica's prefix cache) the others follow, routed by the
same prefix affinity, so the prompt is prefilled once and the other choices read its cached blocks.
A seeded request's choice ``i`` samples with ``seed + i`` (vLLM's rule), so each choice is
reproducible on its own. Usage counts the prompt once and the completions of every choice.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from llm_service.outputs import RequestOutput
from llm_service.sampling_params import SEED_RANGE, SamplingParams
from router.http.sse import DONE, ChunkRenderer
from router.journey.detokenizer import IncrementalDetokenizer
from router.protocol.chat_output import ChoiceLogprobs, TokenLogprobEntry
from router.protocol.errors import APIError, from_exception

Stream = AsyncGenerator[RequestOutput, None]


def child_ids(request_id: str, n: int) -> list[str]:
    return [f"{request_id}-{i}" for i in range(1, n)]


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    if params.seed is None:
        return params
    lo, hi = SEED_RANGE
    return replace(params, seed=(params.seed + index - lo) % (hi - lo) + lo)


@dataclass
class ChoiceState:
    """One choice as it streams: its detokenizer, text, logprobs and how it ended."""

    index: int
    detok: IncrementalDetokenizer
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobEntry] = field(default_factory=list)
    completion_tokens: int = 0
    last: RequestOutput | None = None
    finish: str | None = None

    def add(self, out: RequestOutput, lp: ChoiceLogprobs | None) -> str:
        """Take one output; returns its new text (and sets ``finish`` on the last)."""
        self.last = out
        self.completion_tokens += len(out.new_token_ids)
        text = self.detok.add(out.new_token_ids, final=out.finished)
        self.text.append(text)
        if lp is not None and lp.content:
            self.logprobs.extend(lp.content)
        if self.detok.stopped:
            self.finish = "stop"
        elif out.finished:
            self.finish = out.finish_reason
        return text


async def first_outputs(streams: list[Stream]) -> list[RequestOutput]:
    """Each stream's first output (all started together); every stream closed if one fails."""
    try:
        return list(await asyncio.gather(*(anext(s) for s in streams)))
    except BaseException:
        await close_all(streams)
        raise


async def close_all(streams: list[Stream]) -> None:
    for s in streams:
        await s.aclose()  # a choice still running is aborted on its replica now


async def _chain(first: RequestOutput, rest: Stream) -> AsyncIterator[RequestOutput]:
    yield first
    if first.finished:
        return
    async for out in rest:
        yield out


async def collect(
    states: list[ChoiceState],
    firsts: list[RequestOutput],
    streams: list[Stream],
    logprobs: Callable[[RequestOutput], ChoiceLogprobs | None],
    settle: Callable[[int], Awaitable[None]],
) -> None:
    """Run every choice to its end (together); ``settle(index)`` is awaited as each ends."""

    async def one(state: ChoiceState, first: RequestOutput, stream: Stream) -> None:
        try:
            async for out in _chain(first, stream):
                state.add(out, logprobs(out))
                if state.finish is not None:
                    break
        finally:
            await stream.aclose()
        await settle(state.index)

    try:
        await asyncio.gather(*(one(s, f, st) for s, f, st in zip(states, firsts, streams, strict=True)))
    finally:
        await close_all(streams)


class ChoiceEvents(Protocol):
    """How an endpoint writes its choices' SSE events (chat's deltas; completions' text pieces)."""

    def opening(self, state: ChoiceState) -> str:
        """The choice's first event, before any token ("": none)."""
        ...

    def delta(self, state: ChoiceState, text: str, out: RequestOutput) -> str:
        """The event of ``out``'s new ``text`` (``state.finish`` set on the last)."""
        ...


class _ChatEvents:
    def __init__(
        self,
        request_id: str,
        model: str,
        states: list[ChoiceState],
        logprobs: Callable[[RequestOutput], ChoiceLogprobs | None],
    ) -> None:
        self.request_id, self.model, self.logprobs = request_id, model, logprobs
        self.renderers = [ChunkRenderer(request_id, model, index=s.index) for s in states]
        self.sent = [0] * len(states)  # logprob entries each choice's events carried so far

    def opening(self, state: ChoiceState) -> str:
        return self.renderers[state.index].role()

    def delta(self, state: ChoiceState, text: str, out: RequestOutput) -> str:
        """Its logprobs are the entries ``state.add`` decoded for this output (not decoded again)."""
        lp = None
        if out.new_logprobs:
            new = state.logprobs[self.sent[state.index] :]
            self.sent[state.index] = len(state.logprobs)
            lp = ChoiceLogprobs(content=new) if new else None
        return _delta(self.renderers[state.index], self.request_id, self.model, state, text, lp)


async def stream_events(
    request_id: str,
    model: str,
    states: list[ChoiceState],
    firsts: list[RequestOutput],
    streams: list[Stream],
    logprobs: Callable[[RequestOutput], ChoiceLogprobs | None],
    settle: Callable[[int], Awaitable[None]],
    on_error: Callable[[BaseException], None],
    events: ChoiceEvents | None = None,
) -> AsyncIterator[str]:
    """The SSE events of every choice as their tokens come (each event names its choice's
    ``index``; ``events`` writes them, chat's chunks by default), then ``[DONE]``; an error after
    the 200 travels in-band, as for one choice. ``states[i]`` is the choice of ``streams[i]``."""
    render = events or _ChatEvents(request_id, model, states, logprobs)
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, first: RequestOutput, stream: Stream) -> None:
        try:
            async for out in _chain(first, stream):
                await queue.put((i, out))
        except Exception as e:
            await queue.put(e)
        finally:
            await queue.put(None)

    tasks = [
        asyncio.ensure_future(pump(i, f, st)) for i, (f, st) in enumerate(zip(firsts, streams, strict=True))
    ]
    open_count = len(tasks)
    try:
        for s in states:
            if opening := render.opening(s):
                yield opening
        while open_count:
            item = await queue.get()
            if item is None:
                open_count -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            i, out = item
            state = states[i]
            if state.finish is not None:
                continue
            text = state.add(out, logprobs(out))
            if state.finish is not None:  # what its answer must not end before
                await settle(i)
            if text or state.finish:
                yield render.delta(state, text, out)
            if state.finish is not None:
                await streams[i].aclose()
    except Exception as e:
        on_error(e)
        api = from_exception(e) or APIError(500, "internal error while generating", code="internal_error")
        yield f"data: {json.dumps(api.body())}\n\n"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_all(streams)


def _delta(
    r: ChunkRenderer, request_id: str, model: str, state: ChoiceState, text: str, lp: ChoiceLogprobs | None
) -> str:
    if lp is None:
        return r.delta(text, state.finish)
    from router.protocol.chat_output import ChatCompletionChunk, Delta, StreamChoice

    c = ChatCompletionChunk(
        id=request_id,
        model=model,
        choices=[
            StreamChoice(
                index=state.index, delta=Delta(content=text), finish_reason=state.finish, logprobs=lp
            )
        ],
    )
    return f"data: {c.model_dump_json(exclude_none=True)}\n\n"


__all__ = [
    "DONE",
    "ChoiceEvents",
    "ChoiceState",
    "child_ids",
    "child_params",
    "collect",
    "first_outputs",
    "stream_events",
]
