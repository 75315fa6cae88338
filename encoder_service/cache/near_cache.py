"""``NearCache``: an ingress replica's short memory of the encoder-cache entries it has just seen.

The hit path (``RequestPreparer.prepare_hits``) asks it before the shared index: an item this ingress
prepared or found in the last ``ttl_s`` seconds is served without a shard round trip (a multi-turn
chat re-sends its image every turn). It is filled from the shard's hit answers and from ``prepare``
replies (``PreparedRequest.metas``), keyed by mm_hash like the index (content, never a uuid name).

What it may cost, and why it stays correct:
  - It holds at most ``max_entries`` refs, each for at most ``ttl_s`` (plus the owner's sweep
    period, ``purge``): Ray keeps those objects alive that long even if the index evicted them (the
    same as a request in flight holding its refs).
  - An entry whose object was lost (its encoder replica died) fails the LLM's fetch with
    ``EmbeddingsLost``; the router drops it here (``drop``) and prepares the request again, as it
    does for a stale index entry.
  - Its hits do not refresh the index's LRU; after ``ttl_s`` the index is asked again.
Pure Python: no Ray, no torch.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from encoder_service.types import EmbeddingMeta

DEFAULT_ENTRIES = 256
DEFAULT_TTL_S = 30.0


class NearCache:
    def __init__(
        self,
        max_entries: int = DEFAULT_ENTRIES,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 0 or ttl_s < 0:
            raise ValueError("max_entries and ttl_s must be >= 0")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        # mm_hash -> (meta, ObjectRef: held, never resolved here, deadline)
        self._entries: OrderedDict[str, tuple[EmbeddingMeta, object, float]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, mm_hash: str) -> tuple[EmbeddingMeta, object] | None:
        entry = self._entries.get(mm_hash)
        if entry is not None and entry[2] <= self._clock():
            del self._entries[mm_hash]
            entry = None
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(mm_hash)
        self.hits += 1
        return entry[0], entry[1]

    def put(self, meta: EmbeddingMeta, ref: object) -> None:
        """Remember ``meta``'s entry for ``ttl_s`` from now. Only what the index (or a ``prepare``
        that just asked it) answered is put, never an entry served from here."""
        if self.max_entries == 0 or self.ttl_s == 0:
            return
        self._entries.pop(meta.mm_hash, None)
        self._entries[meta.mm_hash] = (meta, ref, self._clock() + self.ttl_s)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def purge(self) -> int:
        """Forget every expired entry (their objects are released now, not at the next lookup of
        the same item); how many went."""
        now = self._clock()
        expired = [h for h, (_, _, deadline) in self._entries.items() if deadline <= now]
        for h in expired:
            del self._entries[h]
        return len(expired)

    def drop(self, mm_hashes: Iterable[str]) -> None:
        for h in mm_hashes:
            self._entries.pop(h, None)

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._entries), "hits": self.hits, "misses": self.misses}
