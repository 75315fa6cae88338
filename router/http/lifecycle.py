"""What every generation route does around its answer, whatever the endpoint: cancel the work when
the client hangs up before the response starts, hand the admission ticket and the request's span to
a streamed body (released with its last chunk), read a stream's first output, and count usage."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from opentelemetry import context as otel_context
from opentelemetry.trace import Span

from llm_service.outputs import RequestOutput
from router.http import tracing
from router.http.sse import DONE
from router.protocol.errors import APIError
from router.protocol.openai import PromptTokensDetails, Usage
from router.routing.admission import AdmissionController, Ticket

_Chunk = TypeVar("_Chunk")  # a response body's chunk (str, bytes or memoryview)


def hand_over(
    response: Response | None,
    admission: AdmissionController,
    ticket: Ticket,
    span: tuple[Span, otel_context.Token[otel_context.Context]],
    error: BaseException | None,
) -> None:
    """The request's handler is done: a streamed response releases ``ticket`` and ends its span
    (``tracing.start_request_span``'s pair) when its body ends (or is dropped); any other answer does now."""
    sp, traced = span
    if isinstance(response, StreamingResponse):
        response.body_iterator = _release_after(response.body_iterator, admission, ticket)
        weakref.finalize(response.body_iterator, admission.release, ticket)
        if sp.is_recording():  # its span ends with the body
            response.body_iterator = tracing.ended_after(response.body_iterator, sp)
        tracing.end_request_span(sp, traced, end=not sp.is_recording())
    else:
        admission.release(ticket)
        tracing.end_request_span(sp, traced, error)


def usage_of(last: RequestOutput, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=last.num_prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=last.num_prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=last.num_cached_tokens),
    )


async def _release_after(
    body: AsyncIterable[_Chunk], admission: AdmissionController, ticket: Ticket
) -> AsyncIterator[_Chunk]:
    """``body``, then the admission ticket back: before the response's last chunk (the one that ends
    with ``[DONE]``) goes out, so a client that saw the end may be admitted again at once."""
    try:
        async for chunk in body:
            if isinstance(chunk, str) and chunk.endswith(DONE):
                admission.release(ticket)
            yield chunk
    finally:
        admission.release(ticket)


async def cancel_on_disconnect(request: Request, task: asyncio.Task[object] | None) -> None:
    """Cancel ``task`` when the client hangs up before the response starts (no polling: the body was
    read, so the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            if task is not None:
                task.cancel()
            return
        await asyncio.sleep(0.1)  # a server that answers with empty body chunks must not spin us


async def first_or_error(stream: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    try:
        return await stream.__anext__()
    except StopAsyncIteration as e:
        raise APIError(500, "the engine returned no output", code="internal_error") from e
    except BaseException:
        await stream.aclose()
        raise


async def chain(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield first
    if first.finished:
        return
    async for out in rest:
        yield out
