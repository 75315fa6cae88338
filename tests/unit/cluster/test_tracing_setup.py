"""cluster/tracing.py: tracing is off unless the standard OTEL_* variables (or the trace directory)
ask for it, and the per-process file exporter writes spans that read back whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from cluster.tracing import FileSpanExporter, tracing_wanted


@pytest.mark.parametrize(
    ("env", "wanted"),
    [
        ({}, False),  # off by default
        ({"OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
        ({"MMSERVE_TRACE_FILE_DIR": "/tmp/x"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_SERVICE_NAME": "mmserve"}, False),
    ],
)
def test_tracing_is_off_unless_asked(env: dict[str, str], wanted: bool) -> None:
    assert tracing_wanted(env) is wanted


def test_file_exporter_writes_one_json_line_per_span(tmp_path: Path) -> None:
    provider = TracerProvider()  # not the process's global one
    provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(tmp_path / "spans" / "1.jsonl")))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("outer", attributes={"mmserve.request_id": "r1"}):
        tracer.start_span("inner").end()
    lines = (tmp_path / "spans" / "1.jsonl").read_text().splitlines()
    inner, outer = (json.loads(line) for line in lines)  # in the order they ended
    assert (inner["name"], outer["name"]) == ("inner", "outer")
    assert inner["parent_id"] == outer["context"]["span_id"]
    assert outer["attributes"] == {"mmserve.request_id": "r1"}
