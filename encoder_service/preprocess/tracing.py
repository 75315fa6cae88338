"""Spans of a request's journey, through the OpenTelemetry API only: every call here is a no-op
(a non-recording span, one context read) until the process's tracer provider is set
(``cluster/tracing.py``, from the standard ``OTEL_*`` variables) and the request is sampled.

A request's context crosses processes inside the calls' own records as W3C trace headers
(``headers()``, as vLLM carries ``trace_headers`` in its engine requests), so Serve handle calls and
direct links carry it alike. Stage spans are written when the stage's time is observed (``stage_span``:
its end is now, or ``ago`` seconds back), so the code that times a stage for its histogram also
traces it, with no second pair of clock reads.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

TRACER = trace.get_tracer("mmserve")  # follows the provider set later (a proxy until then)
REQUEST_ID = "mmserve.request_id"
MM_HASH = "mmserve.mm_hash"
MM_HASHES = "mmserve.mm_hashes"


def headers() -> dict[str, str] | None:
    """The current span's context for the next process, or None when nothing is being recorded."""
    if not trace.get_current_span().is_recording():
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def current() -> otel_context.Context | None:
    """The current context if a span in it is recording (for work another task does later)."""
    if not trace.get_current_span().is_recording():
        return None
    return otel_context.get_current()


@contextlib.contextmanager
def remote_span(name: str, carrier: dict[str, str] | None, request_id: str) -> Iterator[trace.Span | None]:
    """A span for this process's part of a request whose caller sent ``carrier`` (None: untraced, and
    this yields None)."""
    if not carrier:
        yield None
        return
    parent = propagate.extract(carrier)
    with TRACER.start_as_current_span(
        name, context=parent, kind=trace.SpanKind.SERVER, attributes={REQUEST_ID: request_id}
    ) as span:
        yield span


def stage_span(
    name: str,
    seconds: float,
    ago: float = 0.0,
    mm_hash: str | None = None,
    parent: otel_context.Context | None = None,
) -> None:
    """A child span of ``parent`` (default: the current context) for a stage that took ``seconds``
    and ended ``ago`` seconds back."""
    if not trace.get_current_span(parent).is_recording():
        return
    end = time.time_ns() - int(ago * 1e9)
    span_between(name, end - int(seconds * 1e9), end, mm_hash, parent)


def span_between(
    name: str,
    start_ns: int,
    end_ns: int,
    mm_hash: str | None = None,
    parent: otel_context.Context | None = None,
) -> None:
    """A child span of ``parent`` (default: the current context) between two wall-clock reads."""
    if not trace.get_current_span(parent).is_recording():
        return
    span = TRACER.start_span(
        name, context=parent, start_time=start_ns, attributes={MM_HASH: mm_hash} if mm_hash else None
    )
    span.end(end_time=end_ns)
