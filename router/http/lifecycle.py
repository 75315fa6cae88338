"""What every generation route does around its answer, whatever the endpoint: read the body into the
admission's byte budget and admit it (``read_and_admit``), run the answer inside the request's span
while cancelling it when the client hangs up before the response starts (``answer_admitted``), hand the
admission ticket and the span to a streamed body (released with its last chunk), read a stream's
first output, and count usage."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from opentelemetry import context as otel_context
from opentelemetry.trace import Span
from pydantic import BaseModel

from llm_service.outputs import RequestOutput
from router.http import tracing
from router.http.request_body import read_body
from router.http.sse import DONE
from router.journey.deadline import Deadline
from router.protocol.chat_output import PromptTokensDetails, Usage
from router.protocol.errors import APIError
from router.routing.admission import AdmissionController, BodyLease, Ticket

_Chunk = TypeVar("_Chunk")  # a response body's chunk (str, bytes or memoryview)
_Body = TypeVar("_Body", bound=BaseModel)  # a route's parsed request body
_Asked = TypeVar("_Asked")  # what a route makes of its body once checked


async def read_and_admit(
    request: Request,
    body_type: type[_Body],
    limits: tuple[int, int],
    admission: AdmissionController,
    deadline: Deadline,
    ask: Callable[[_Body], tuple[_Asked, int]],
) -> tuple[_Body, _Asked, Ticket]:
    """The body, read as it arrives within ``limits`` (bytes, JSON values) with its bytes reserved in the
    admission's body budget (a 503 past it); ``ask``: every 400 the body can earn before anything runs,
    returning what it asks and its admission cost; then the admission's ticket, which takes the body's
    bytes over. Whatever fails on the way (refused, bad input, the client leaving) gives the bytes back."""
    lease = BodyLease()
    try:
        max_bytes, max_json_values = limits
        req = await deadline.run(
            read_body(
                request, body_type, max_bytes, max_json_values, lambda n: admission.reserve_body(lease, n)
            )
        )
        asked, cost = ask(req)
        return req, asked, admission.admit(cost, body=lease)
    except BaseException:
        admission.release_body(lease)
        raise


async def answer_admitted(
    request: Request,
    admission: AdmissionController,
    ticket: Ticket,
    ids: tuple[str, str],
    answer: Callable[[], Awaitable[Response]],
    failed: Callable[[Exception], None],
    left: Callable[[], None] = lambda: None,
) -> Response:
    """``answer()`` for an admitted request (``ids``: its request id and model name) inside its span,
    cancelled if the client hangs up before the response starts; ``failed(e)`` on our side's failure,
    ``left()`` when the client left. The ticket and span then go to the streamed body, or end now."""
    request_id, model_name = ids
    span = tracing.start_request_span(request.headers, request_id, model_name)
    watcher = asyncio.ensure_future(cancel_on_disconnect(request, asyncio.current_task()))
    response: Response | None = None
    error: BaseException | None = None
    try:
        response = await answer()
        return response
    except Exception as e:
        error = e
        failed(e)
        raise
    except BaseException:  # the client left: nothing failed on our side
        left()
        raise
    finally:  # a streamed response watches for the disconnect itself from here on
        watcher.cancel()
        hand_over(response, admission, ticket, span, error)


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
