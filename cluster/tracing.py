"""Tracing for one process of the app: the OpenTelemetry SDK's tracer provider, set from the
standard ``OTEL_*`` variables where the process runs. Off unless asked for:

- ``OTEL_TRACES_EXPORTER=otlp`` (or an ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``): spans go to an OTLP collector, over HTTP/protobuf or gRPC
  as ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`` says (needs ``pip install 'mmserve[otlp]'``);
  ``OTEL_TRACES_EXPORTER=console``: to stdout;
- ``MMSERVE_TRACE_FILE_DIR``: every process also writes its spans there, one JSON line per span,
  to ``<pid>.jsonl`` (tests, and a look without a collector).

Sampling is the SDK's own (``OTEL_TRACES_SAMPLER``, ``OTEL_TRACES_SAMPLER_ARG``; default: every
request, or as the client's ``traceparent`` says). ``OTEL_SERVICE_NAME`` names the service
(default ``mmserve``); each process adds its role (``mmserve.role``: ingress, encoder, llm).

The services only use the OpenTelemetry API (encoder_service/preprocess/tracing.py, llm_service/tracing.py):
nothing is recorded in a process where this did not set a provider.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

logger = logging.getLogger("mmserve.tracing")

FILE_DIR_ENV = "MMSERVE_TRACE_FILE_DIR"
_lock = threading.Lock()
_done = False


def tracing_wanted(env: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporters = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    return bool(env.get(FILE_DIR_ENV)) or bool(endpoint) or exporters not in ("", "none")


def setup_tracing(role: str) -> bool:
    """Set this process's tracer provider if the environment asks for tracing (once per process);
    whether one is set."""
    global _done
    with _lock:
        if _done:
            return True
        if not tracing_wanted():
            return False
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        resource = Resource.create(
            {
                "service.name": os.environ.get("OTEL_SERVICE_NAME", "mmserve"),
                "mmserve.role": role,
                "process.pid": os.getpid(),
            }
        )
        provider = TracerProvider(resource=resource)  # the sampler from OTEL_TRACES_SAMPLER
        for processor in _processors():
            provider.add_span_processor(processor)
        trace.set_tracer_provider(provider)
        _done = True
        return True


def _processors() -> list[SpanProcessor]:
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    out: list[SpanProcessor] = []
    if directory := os.environ.get(FILE_DIR_ENV):
        out.append(SimpleSpanProcessor(FileSpanExporter(Path(directory) / f"{os.getpid()}.jsonl")))
    names = {n.strip().lower() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()}
    if not names and (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        names = {"otlp"}
    if "console" in names:
        out.append(SimpleSpanProcessor(ConsoleSpanExporter()))
    if "otlp" in names and (otlp := _otlp_exporter()) is not None:
        out.append(BatchSpanProcessor(otlp))
    return out


def _otlp_exporter() -> SpanExporter | None:
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    )
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[no-redef]
                OTLPSpanExporter,
            )
    except ImportError:
        logger.warning(
            "OTEL_TRACES_EXPORTER=otlp, but no OTLP exporter is installed: pip install 'mmserve[otlp]'"
        )
        return None
    return OTLPSpanExporter()  # endpoint, headers, timeout: from the OTEL_EXPORTER_OTLP_* variables


class FileSpanExporter(SpanExporter):
    """Spans as JSON lines appended to one file (one per process: no two writers share it)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self.path.open("a") as f:
            for span in spans:
                f.write(json.dumps(json.loads(span.to_json())) + "\n")
        return SpanExportResult.SUCCESS
