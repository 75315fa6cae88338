"""Encoder-cache books: which embeddings the cache holds, who pins them, what to evict. No tensors.

Capacity is counted in embeddings (``encoder_cache_size``). An entry is created by ``try_allocate``
(reserved, pinned by the computing request), filled by ``commit`` and pinned by every request that
uses it. Unpinned entries wait in an LRU and are evicted oldest first, only when an allocation needs
their space; evicted hashes queue in ``take_freed()`` for whoever holds the tensors.

    entries ─┬─ pinned (pins non-empty): never evicted
             └─ freeable (pins empty, committed): LRU order, evicted on demand
    a reservation (meta None) whose pins all go away is dropped at once: its compute failed.
    a committed entry whose tensor is lost (its owner died) is dropped by ``invalidate``, pins and all.

Modelled on vLLM's EncoderCacheManager. Pure Python: no torch, no Ray.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from encoder_service.errors import EncoderCacheFull
from encoder_service.types import EmbeddingMeta


@dataclass
class CacheEntry:
    num_embeds: int
    meta: EmbeddingMeta | None = None  # None while reserved and not yet committed
    pins: set[str] = field(default_factory=set)

    @property
    def committed(self) -> bool:
        return self.meta is not None


class EncoderCacheBooks:
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("encoder cache capacity must be positive")
        self.capacity = capacity
        self.entries: dict[str, CacheEntry] = {}
        self._freeable: OrderedDict[str, int] = OrderedDict()  # unpinned committed hashes, oldest first
        self._by_request: dict[str, dict[str, None]] = {}  # request -> its hashes, in pin order
        self._freed: list[str] = []
        self.used = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.invalidations = 0

    # ---- queries -------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.capacity - self.used

    @property
    def num_freeable(self) -> int:
        """Embeddings that could be freed right now by evicting every unpinned entry."""
        return sum(self._freeable.values())

    @property
    def num_pinned(self) -> int:
        return sum(1 for e in self.entries.values() if e.pins)

    def lookup(self, mm_hash: str, count: bool = True) -> EmbeddingMeta | None:
        """The committed entry's metadata; a hit refreshes its LRU position. ``count=False`` for a peek
        that is not the decision (the preprocessor's, before the router reserves), so each item is
        counted once as a hit or a miss."""
        entry = self.entries.get(mm_hash)
        if entry is None or entry.meta is None:
            self.misses += count
            return None
        self.hits += count
        if mm_hash in self._freeable:
            self._freeable.move_to_end(mm_hash)
        return entry.meta

    def is_reserved(self, mm_hash: str) -> bool:
        entry = self.entries.get(mm_hash)
        return entry is not None and entry.meta is None

    def can_allocate(self, num_embeds: int) -> bool:
        return num_embeds <= self.num_free + self.num_freeable

    # ---- mutations -----------------------------------------------------------------------------------
    def try_allocate(self, request_id: str, mm_hash: str, num_embeds: int) -> bool:
        """Reserve ``num_embeds`` for ``mm_hash`` pinned by ``request_id``; False if space can't be made now.

        An existing entry (committed or reserved) is pinned instead. Raises ``EncoderCacheFull`` for an
        item larger than the whole cache, which no amount of waiting can fit.
        """
        if num_embeds > self.capacity:
            raise EncoderCacheFull(
                f"item {mm_hash[:16]} needs {num_embeds} embeddings, more than encoder_cache_size={self.capacity}"
            )
        if mm_hash in self.entries:
            self.pin(request_id, mm_hash)
            return True
        if not self.can_allocate(num_embeds):
            return False
        while self.num_free < num_embeds:
            self._evict_oldest()
        self.entries[mm_hash] = CacheEntry(num_embeds)
        self.used += num_embeds
        self.pin(request_id, mm_hash)
        return True

    def commit(self, mm_hash: str, meta: EmbeddingMeta) -> None:
        entry = self.entries.get(mm_hash)
        if entry is None:
            raise KeyError(f"commit of {mm_hash}: no reservation (released or never allocated)")
        if meta.num_embeds != entry.num_embeds:
            raise ValueError(
                f"commit of {mm_hash}: {meta.num_embeds} embeddings, reserved {entry.num_embeds}"
            )
        entry.meta = meta
        if not entry.pins:
            self._freeable[mm_hash] = entry.num_embeds

    def pin(self, request_id: str, mm_hash: str) -> None:
        entry = self.entries[mm_hash]
        entry.pins.add(request_id)
        self._freeable.pop(mm_hash, None)
        self._by_request.setdefault(request_id, {})[mm_hash] = None

    def release(self, request_id: str, mm_hash: str | None = None) -> list[str]:
        """Unpin one item, or every item of the request. Returns the hashes whose reservation was dropped."""
        held = self._by_request.get(request_id, {})
        hashes = [mm_hash] if mm_hash is not None else list(held)
        dropped = []
        for h in hashes:
            held.pop(h, None)
            entry = self.entries.get(h)
            if entry is None or request_id not in entry.pins:
                continue
            entry.pins.discard(request_id)
            if entry.pins:
                continue
            if entry.committed:
                self._freeable[h] = entry.num_embeds
            else:  # the computing request failed before committing
                del self.entries[h]
                self.used -= entry.num_embeds
                dropped.append(h)
        if not held:
            self._by_request.pop(request_id, None)
        return dropped

    def invalidate(self, mm_hash: str) -> bool:
        """Drop a committed entry whose tensor is lost, pinned or not; its space is free at once.

        Pins held by other running requests go with it. Those requests already hold the same lost
        ref: their LLM call fails on it and they recover by themselves (invalidate, re-encode). Their
        pins are forgotten with the entry, so their later ``release`` is a no-op for this hash: it
        never unpins a newer entry computed under the same hash unless they pinned that one too.
        Not counted as an eviction and not queued in ``take_freed``: the caller drops the ref itself.

        A reservation (not committed) is left alone and False is returned: its computing request
        will commit a fresh tensor, or release and drop it.
        """
        entry = self.entries.get(mm_hash)
        if entry is None or not entry.committed:
            return False
        del self.entries[mm_hash]
        self._freeable.pop(mm_hash, None)
        self.used -= entry.num_embeds
        for request_id in entry.pins:
            held = self._by_request.get(request_id)
            if held is None:
                continue
            held.pop(mm_hash, None)
            if not held:
                del self._by_request[request_id]
        self.invalidations += 1
        return True

    def take_freed(self) -> list[str]:
        """Hashes evicted since the last call (their tensors can be dropped)."""
        freed, self._freed = self._freed, []
        return freed

    def _evict_oldest(self) -> None:
        mm_hash, size = self._freeable.popitem(last=False)
        del self.entries[mm_hash]
        self.used -= size
        self.evictions += 1
        self._freed.append(mm_hash)

    def stats(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "used": self.used,
            "entries": len(self.entries),
            "pinned": self.num_pinned,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
        }
