"""The ingress's span of a request (``mmserve.chat``): a child of FastAPI's own HTTP span where FastAPI
traces (it does once a tracer provider is set), else of the client's W3C ``traceparent``, else a
root. Its context goes on to the pools in their calls' records (encoder_service/preprocess/tracing.py)."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Mapping
from typing import TypeVar

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from encoder_service.preprocess.tracing import REQUEST_ID, TRACER

_Chunk = TypeVar("_Chunk")


def start_request_span(
    headers: Mapping[str, str], request_id: str, model: str
) -> tuple[trace.Span, otel_context.Token[otel_context.Context]]:
    """The request's span, made current; returns it and the token ``end_request_span`` detaches."""
    within_http_span = trace.get_current_span().get_span_context().is_valid
    parent = propagate.extract(headers) if not within_http_span and "traceparent" in headers else None
    span = TRACER.start_span(
        "mmserve.chat",
        context=parent,
        kind=trace.SpanKind.SERVER,
        attributes={REQUEST_ID: request_id, "mmserve.model": model},
    )
    return span, otel_context.attach(trace.set_span_in_context(span))


def end_request_span(
    span: trace.Span,
    token: otel_context.Token[otel_context.Context],
    error: BaseException | None = None,
    *,
    end: bool = True,
) -> None:
    """Detach the request's context; end its span (``end=False``: a streamed body ends it later)."""
    otel_context.detach(token)
    if error is not None and span.is_recording():
        span.record_exception(error)
        span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__name__))
    if end:
        span.end()


async def ended_after(body: AsyncIterable[_Chunk], span: trace.Span) -> AsyncIterator[_Chunk]:
    """A streamed response's body; its request's span ends with it."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        span.end()
