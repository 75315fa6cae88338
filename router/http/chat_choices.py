"""``n`` > 1 on the chat route (router/http/choices.py has the choices' machinery): submitted, collected
or streamed, each choice's text parsed for tool calls when the request has tools."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse, Response

from llm_service.outputs import RequestOutput
from llm_service.sampling_params import SamplingParams
from llm_service.tools.formats import ToolFormat
from router.http.choices import ChoiceState, child_ids, child_params, collect, first_outputs, stream_events
from router.http.lifecycle import first_or_error, usage_of
from router.http.reasoning_answer import Thinking, answer_message
from router.http.sse import DONE, SSEResponse
from router.http.tool_answer import ToolChoiceEvents, answer_decoder
from router.journey.deadline import Deadline
from router.journey.detokenizer import IncrementalDetokenizer
from router.journey.orchestrator import Prepared
from router.protocol.chat_output import ChatCompletionChunk, ChatCompletionResponse, Choice, ChoiceLogprobs
from router.protocol.messages import NormalizedChat
from router.protocol.openai import ChatCompletionRequest
from router.protocol.tool_choice import answer_format

if TYPE_CHECKING:
    from router.http.chat import ChatService, ServedModel


def _choice(
    req: ChatCompletionRequest, s: ChoiceState, fmt: ToolFormat | None, thinking: Thinking | None
) -> Choice:
    message, finish = answer_message("".join(s.text), s.finish, fmt, thinking)
    lp = ChoiceLogprobs(content=s.logprobs) if req.logprobs else None
    return Choice(index=s.index, message=message, finish_reason=finish, logprobs=lp)


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
    thinking = Thinking.of(model.reasoning_format, chat.template_kwargs)
    decode = answer_decoder(
        orch, answer_format(req, model.tool_format), thinking.fmt.markers if thinking else ()
    )
    states = [ChoiceState(i, IncrementalDetokenizer(decode, stop=req.stop_strings)) for i in range(req.n)]

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
    fmt = answer_format(req, model.tool_format)
    resp = ChatCompletionResponse(
        id=request_id,
        model=model.name,
        choices=[_choice(req, s, fmt, thinking) for s in states],
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

    fmt = answer_format(req, model.tool_format)
    events = None if fmt is None else ToolChoiceEvents(fmt, ids[0], model.name, states, lp)
    try:
        async for event in stream_events(
            ids[0], model.name, states, firsts, streams, lp, settle, on_error, events
        ):
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
