"""Where a media request's time goes on the encoder side, as the code that does the work reports it
(pure: no Ray; ``metrics.py`` binds these to Prometheus histograms, one per stage, model and pool).

    fetch (URLs only) ─▶ cache_lookup ─▶ media_decode ─▶ preprocess ─▶ encoder_queue ─▶ encode
                              └─ an item another request computes: cache_wait

Each field is pre-bound to its labels, so an observation is one call with no label map built; a
process that runs with stage metrics off holds ``None`` instead of a ``MediaStages`` and times nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class Observer(Protocol):
    def observe(self, value: float) -> None: ...


class Count(Protocol):
    def inc(self, value: float = 1.0) -> None: ...


@dataclass(frozen=True)
class CacheLookups:
    """Encoder-cache answers per item, counted where the answer came from (the near cache or a
    shard), not where it was handed on: a ``prepare`` given the hit path's answers counts nothing."""

    hit: Count
    miss: Count  # reserved for this request: it computes the item
    wait: Count  # another request computes it


@dataclass(frozen=True)
class MediaStages:
    fetch: Observer  # one per item fetched from a URL or a local file
    media_decode: Observer  # one per item decoded (processor-cache hits are not)
    preprocess: Observer  # the family's processor, one per item decoded
    cache_lookup: Observer  # one per request's lookup (near cache, then one call per shard touched)
    cache_wait: Observer  # one per item another request was computing, until it is ours
    lookups: CacheLookups
