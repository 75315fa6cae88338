"""Stage.timing: a timed block's span runs between wall-clock reads at its entry and exit, so it
encloses everything the block caused (another process's span of the same request), however late the
exit's clock reads fall; a block that raises observes nothing."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from encoder_service.preprocess import tracing
from encoder_service.preprocess.stage_timing import Stage


class SlowHistogram:
    """Takes 5 ms per observation, as a thread switch between a stage's clock reads would."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, value: float) -> None:
        time.sleep(0.005)
        self.values.append(value)


def test_a_timed_block_s_span_encloses_what_it_caused(monkeypatch: pytest.MonkeyPatch) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()  # not the process's global one
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    monkeypatch.setattr(tracing, "TRACER", tracer)
    histogram = SlowHistogram()
    stage = Stage("prepare", histogram)
    with tracer.start_as_current_span("request"):
        with stage.timing():
            caused = time.time_ns()  # where another process's span of the request would start
        with pytest.raises(ValueError), stage.timing():
            raise ValueError("a failed prepare is not timed")
    (prepare,) = [s for s in exporter.get_finished_spans() if s.name == "prepare"]
    assert prepare.start_time is not None and prepare.end_time is not None
    assert prepare.start_time <= caused <= prepare.end_time
    assert len(histogram.values) == 1 and 0 <= histogram.values[0] < 0.005


def test_untraced_block_is_timed_only() -> None:
    histogram = SlowHistogram()
    with Stage("prepare", histogram).timing():
        pass
    assert len(histogram.values) == 1
    with Stage("prepare").timing():  # metrics off: nothing to observe
        pass
