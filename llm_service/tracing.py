"""An LLM replica's spans of a sampled request (OpenTelemetry API only: no-ops until the process's
tracer provider is set, cluster/tracing.py). The request's context comes in its spec
(``LLMRequestSpec.trace_headers``); its ``llm.request`` span and the ``llm_queue``, ``prefill`` and
``decode`` spans under it are written when its last output comes out of the engine, from the
engine's own timing of it (``RequestTiming``), so the engine thread and the per-token path do
nothing for them."""

from __future__ import annotations

import time
from collections import OrderedDict

from opentelemetry import context, propagate, trace

from llm_service.outputs import RequestOutput

TRACER = trace.get_tracer("mmserve")
MAX_OPEN = 4096  # traced requests remembered until their last output (aborted ones age out)


class RequestTraces:
    def __init__(self) -> None:
        # request id -> its caller's context, when it arrived (ns), its span's attributes
        self._open: OrderedDict[str, tuple[context.Context, int, dict[str, str | list[str]]]] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._open)

    def start(self, request_id: str, headers: dict[str, str] | None, mm_hashes: list[str]) -> None:
        """The request arrived (``headers``: its caller's trace context; None: not sampled)."""
        if not headers:
            return
        attrs: dict[str, str | list[str]] = {"mmserve.request_id": request_id, "mmserve.mm_hashes": mm_hashes}
        self._open[request_id] = (propagate.extract(headers), time.time_ns(), attrs)
        while len(self._open) > MAX_OPEN:
            self._open.popitem(last=False)

    def finish(self, out: RequestOutput) -> None:
        """``out`` is a request's last output from the engine: write its spans."""
        opened = self._open.pop(out.request_id, None)
        if opened is None or out.timing is None:
            return
        parent, start, attrs = opened
        end = time.time_ns()
        t = out.timing
        decode_at = end - int(t.decode * 1e9)
        prefill_at = decode_at - int(t.prefill * 1e9)
        queue_at = prefill_at - int(t.queue * 1e9)
        root = TRACER.start_span(
            "llm.request",
            context=parent,
            kind=trace.SpanKind.SERVER,
            start_time=min(start, queue_at),
            attributes=attrs,
        )
        inside = trace.set_span_in_context(root)
        for name, begin, until in (
            ("llm_queue", queue_at, prefill_at),
            ("prefill", prefill_at, decode_at),
            ("decode", decode_at, end),
        ):
            TRACER.start_span(name, context=inside, start_time=begin).end(end_time=until)
        root.end(end_time=end)
