"""Where a media request's time goes on the encoder side, as the code that does the work reports it
(no Ray here: ``metrics.py`` binds each stage to a Prometheus histogram per model and pool).

    fetch (URLs only) ─▶ cache_lookup ─▶ media_decode ─▶ preprocess ─▶ encoder_queue ─▶ encode
                              └─ an item another request computes: cache_wait

A ``Stage`` observation goes to its histogram (bound to its labels once: no label map is built per
call; None when ``MMSERVE_STAGE_METRICS=0``) and, for a sampled request, becomes a span of its trace.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from encoder_service.preprocess.tracing import span_between, stage_span

if TYPE_CHECKING:
    from opentelemetry.context import Context


class Observer(Protocol):
    def observe(self, value: float) -> None: ...


class Count(Protocol):
    def inc(self, value: float = 1.0) -> None: ...


class Stage:
    __slots__ = ("histogram", "name")

    def __init__(self, name: str, histogram: Observer | None = None) -> None:
        self.name = name
        self.histogram = histogram

    def observe(
        self, seconds: float, *, ago: float = 0.0, mm_hash: str | None = None, parent: Context | None = None
    ) -> None:
        """The stage took ``seconds`` and ended ``ago`` seconds back; ``parent``: the request's trace
        context when this runs outside the request's own task."""
        if self.histogram is not None:
            self.histogram.observe(seconds)
        stage_span(self.name, seconds, ago, mm_hash, parent)

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        """Times the block (nothing is observed if it raises). Its span runs between wall-clock reads
        taken at entry and exit, not back from a duration, so it encloses all the block caused in
        other processes even when a thread switch falls between the exit's clock reads."""
        start_ns, start = time.time_ns(), time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        if self.histogram is not None:
            self.histogram.observe(seconds)
        span_between(self.name, start_ns, time.time_ns())


@dataclass(frozen=True)
class CacheLookups:
    """Encoder-cache answers per item, counted where the answer came from (the near cache or a
    shard), not where it was handed on: a ``prepare`` given the hit path's answers counts nothing."""

    hit: Count
    miss: Count  # reserved for this request: it computes the item
    wait: Count  # another request computes it


@dataclass(frozen=True)
class MediaStages:
    fetch: Stage  # one per item fetched from a URL or a local file
    media_decode: Stage  # one per item decoded (processor-cache hits are not)
    preprocess: Stage  # the family's processor, one per item decoded
    cache_lookup: Stage  # one per request's lookup (near cache, then one call per shard touched)
    cache_wait: Stage  # one per item another request was computing, until it is ours
    lookups: CacheLookups | None  # None: metrics off
