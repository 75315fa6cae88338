"""``n`` > 1: several answers to one prompt. The first choice is submitted alone; once its first token
is out (the prompt's KV blocks are in its replica's prefix cache) the others follow, routed by the
same prefix affinity, so the prompt is prefilled once and the other choices read its cached blocks.
A seeded request's choice ``i`` samples with ``seed + i`` (vLLM's rule), so each choice is
reproducible on its own. Usage counts the prompt once and the completions of every choice.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse, Response

from llm_service.outputs import RequestOutput
from llm_service.sampling_params import SEED_RANGE, SamplingParams
from router.http.sse import DONE, ChunkRenderer, SSEResponse
from router.journey.deadline import Deadline
from router.journey.detokenizer import IncrementalDetokenizer
from router.journey.orchestrator import Prepared
from router.protocol.errors import APIError, from_exception
from router.protocol.messages import NormalizedChat
from router.protocol.openai import (
    AssistantMessage,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    Choice,
    ChoiceLogprobs,
    PromptTokensDetails,
    TokenLogprobEntry,
    Usage,
)

if TYPE_CHECKING:
    from router.http.chat import ChatService, ServedModel

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


async def stream_events(
    request_id: str,
    model: str,
    states: list[ChoiceState],
    firsts: list[RequestOutput],
    streams: list[Stream],
    logprobs: Callable[[RequestOutput], ChoiceLogprobs | None],
    settle: Callable[[int], Awaitable[None]],
    on_error: Callable[[BaseException], None],
) -> AsyncIterator[str]:
    """The SSE events of every choice as their tokens come (each event names its choice's
    ``index``), then ``[DONE]``; an error after the 200 travels in-band, as for one choice."""
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, first: RequestOutput, stream: Stream) -> None:
        try:
            async for out in _chain(first, stream):
                await queue.put((i, out))
        except Exception as e:
            await queue.put(e)
        finally:
            await queue.put(None)

    renderers = [ChunkRenderer(request_id, model, index=s.index) for s in states]
    tasks = [
        asyncio.ensure_future(pump(i, f, st)) for i, (f, st) in enumerate(zip(firsts, streams, strict=True))
    ]
    open_count = len(tasks)
    try:
        for r in renderers:
            yield r.role()
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
                lp = logprobs(out) if out.new_logprobs else None
                yield _delta(renderers[i], request_id, model, state, text, lp)
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
    from router.protocol.openai import ChatCompletionChunk, Delta, StreamChoice

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


def usage_of(last: RequestOutput, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=last.num_prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=last.num_prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=last.num_cached_tokens),
    )


async def first_or_error(stream: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    try:
        return await stream.__anext__()
    except StopAsyncIteration as e:
        raise APIError(500, "the engine returned no output", code="internal_error") from e
    except BaseException:
        await stream.aclose()
        raise


async def answer_choices(
    svc: ChatService,
    req: ChatCompletionRequest,
    model: ServedModel,
    request_id: str,
    chat: NormalizedChat,
    prepared: Prepared,
    params: SamplingParams,
    start: float,
    deadline: Deadline,
    cache_salt: str | None,
) -> Response:
    """``n`` > 1 (router/http/choices.py): the first choice alone until its first token, then the
    others on the prompt's cached blocks."""
    orch = model.orchestrator
    ids = [request_id, *child_ids(request_id, req.n)]
    for cid in ids[1:]:
        orch.fork(request_id, cid)
    try:
        first_stream = deadline.stream(orch.stream(request_id, prepared, params, cache_salt))
        first = await first_or_error(first_stream)
        shared = Prepared(prepared.prompt_token_ids, prepared.mm_items)
        rest = [
            deadline.stream(orch.stream(cid, shared, child_params(params, i), cache_salt))
            for i, cid in enumerate(ids[1:], start=1)
        ]
        try:
            firsts = [first, *await first_outputs(rest)]
        except BaseException:
            await first_stream.aclose()
            raise
    except BaseException:
        for cid in ids[1:]:
            orch.forget(cid)
        raise
    streams = [first_stream, *rest]
    first_at = time.monotonic()
    if (timed := svc.metrics.model(model.name) if svc.metrics is not None else None) is not None:
        timed.ttft.observe(first_at - start)
    states = [
        ChoiceState(i, IncrementalDetokenizer(orch.decode, stop=req.stop_strings)) for i in range(req.n)
    ]

    def lp(out: RequestOutput) -> ChoiceLogprobs | None:
        return svc._logprobs(orch, out) if req.logprobs else None

    async def settle(i: int) -> None:
        await orch.settle(ids[i])

    if req.stream:
        gen = _sse_choices(svc, req, model, ids, states, firsts, streams, lp, settle, (start, first_at), chat)
        return SSEResponse(gen, media_type="text/event-stream")
    try:
        await collect(states, firsts, streams, lp, settle)
    finally:
        for cid in ids[1:]:
            orch.forget(cid)
    total = sum(s.completion_tokens for s in states)
    svc._observe_done(model.name, (start, first_at), total)
    resp = ChatCompletionResponse(
        id=request_id,
        model=model.name,
        choices=[
            Choice(
                index=s.index,
                message=AssistantMessage(content="".join(s.text)),
                finish_reason=s.finish,
                logprobs=ChoiceLogprobs(content=s.logprobs) if req.logprobs else None,
            )
            for s in states
        ],
        usage=usage_of(firsts[0] if states[0].last is None else states[0].last, total),
    )
    orch.forget(request_id)
    return JSONResponse(resp.model_dump(exclude_none=False))


async def _sse_choices(
    svc: ChatService,
    req: ChatCompletionRequest,
    model: ServedModel,
    ids: list[str],
    states: list[ChoiceState],
    firsts: list[RequestOutput],
    streams: list[AsyncGenerator[RequestOutput, None]],
    lp: Callable[[RequestOutput], ChoiceLogprobs | None],
    settle: Callable[[int], Awaitable[None]],
    times: tuple[float, float],
    chat: NormalizedChat,
) -> AsyncIterator[str]:
    orch = model.orchestrator
    failed: list[BaseException] = []

    def on_error(e: BaseException) -> None:
        failed.append(e)
        svc._log_failure(orch, ids[0], chat, e)

    try:
        async for event in stream_events(ids[0], model.name, states, firsts, streams, lp, settle, on_error):
            yield event
        total = sum(s.completion_tokens for s in states)
        tail = ""
        if not failed and req.stream_options is not None and req.stream_options.include_usage:
            last = states[0].last or firsts[0]
            usage = ChatCompletionChunk(id=ids[0], model=model.name, choices=[], usage=usage_of(last, total))
            tail = f"data: {usage.model_dump_json()}\n\n"
        if not failed:
            svc._observe_done(model.name, times, total)
    finally:
        for rid in ids:
            orch.forget(rid)
    yield tail + DONE
