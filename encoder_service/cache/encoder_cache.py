"""Encoder-cache books: which embeddings the cache holds, who is computing which, what to evict.
No tensors.

Capacity is counted in embeddings (``encoder_cache_size``) and charged when an entry is committed.
A miss is answered with a *reservation* held by the computing request under a lease; ``commit`` fills
it. Requests that use a committed entry do not pin it: they hold the entry's ObjectRef themselves
from the lookup on, so the object outlives an eviction for as long as they need it (the owning
encoder replica keeps a strong ref for a grace period after eviction, ``owned_embeddings``). The
cache bounds what it keeps for reuse; what running requests hold is bounded by admission.

    entries ─┬─ reserved (meta None): held by one request until its commit, its release, or its
             │                        lease runs out (a dead holder frees it; live ones renew)
             └─ committed: LRU order, evicted oldest first when a commit needs their space
    a committed entry whose tensor is lost (its owner died) is dropped by ``invalidate``.

Modelled on vLLM's EncoderCacheManager, without its per-request pins: here the embeddings live in
Ray's object store, which counts references for us. Pure Python: no torch, no Ray.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum

from encoder_service.preprocess.errors import EncoderCacheFull
from encoder_service.types import EmbeddingMeta

DEFAULT_LEASE_S = 15.0


class CacheReply(StrEnum):
    """The cache's answer for one mm_hash. A ``str`` Enum: each member equals its string
    (``CacheReply.HIT == "hit"``), so code that compares the strings keeps working."""

    HIT = "hit"  # committed: its meta and ref come with the answer (counted, LRU refreshed)
    COMPUTE = "compute"  # reserved for the asking request: it computes and commits, or releases
    WAIT = "wait"  # another live request holds the reservation: ask again after your own encodes
    RELEASED = "released"  # the asking request was released meanwhile (a shard's answer, not the books')


# The names before ``CacheReply`` (preprocess/prepare.py and tests import them); prefer the members.
HIT, COMPUTE, WAIT = CacheReply.HIT, CacheReply.COMPUTE, CacheReply.WAIT


@dataclass
class CacheEntry:
    num_embeds: int = 0  # what it is charged (embeddings x units), at commit; 0 while reserved
    meta: EmbeddingMeta | None = None  # None while reserved and not yet committed
    holder: str | None = None  # the request computing it, while reserved
    lease_until: float = 0.0  # the reservation is freeable after this time (monotonic seconds)

    @property
    def committed(self) -> bool:
        return self.meta is not None


class EncoderCacheBooks:
    def __init__(self, capacity: int, lease_s: float = DEFAULT_LEASE_S) -> None:
        if capacity <= 0:
            raise ValueError("encoder cache capacity must be positive")
        if lease_s <= 0:
            raise ValueError("reservation lease must be positive")
        self.capacity = capacity
        self.lease_s = lease_s
        self.entries: dict[str, CacheEntry] = {}
        self._lru: OrderedDict[str, int] = OrderedDict()  # committed hashes, least recently used first
        self._by_request: dict[str, dict[str, None]] = {}  # request -> the hashes it reserved
        self._freed: list[str] = []
        self.used = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.invalidations = 0
        self.expired = 0

    # ---- queries -------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.capacity - self.used

    @property
    def num_reserved(self) -> int:
        return sum(1 for e in self.entries.values() if e.meta is None)

    def lookup(self, mm_hash: str, count: bool = True) -> EmbeddingMeta | None:
        """The committed entry's metadata; a hit refreshes its LRU position. ``count=False`` for a peek."""
        entry = self.entries.get(mm_hash)
        if entry is None or entry.meta is None:
            self.misses += count
            return None
        self.hits += count
        self._lru.move_to_end(mm_hash)
        return entry.meta

    def is_reserved(self, mm_hash: str) -> bool:
        entry = self.entries.get(mm_hash)
        return entry is not None and entry.meta is None

    def holder(self, mm_hash: str) -> str | None:
        entry = self.entries.get(mm_hash)
        return None if entry is None else entry.holder

    def lease_deadline(self, mm_hash: str) -> float | None:
        entry = self.entries.get(mm_hash)
        return None if entry is None or entry.committed else entry.lease_until

    # ---- mutations -----------------------------------------------------------------------------------
    def lookup_or_reserve(self, request_id: str, mm_hash: str, now: float) -> CacheReply:
        """``HIT`` (counted, LRU refreshed), ``COMPUTE`` (reserved for ``request_id`` until
        ``now + lease_s``; also when it already holds it) or ``WAIT`` (another live request holds
        the reservation). An expired reservation is taken over."""
        entry = self.entries.get(mm_hash)
        if entry is not None and entry.meta is not None:
            self.hits += 1
            self._lru.move_to_end(mm_hash)
            return CacheReply.HIT
        if entry is not None and entry.holder != request_id and entry.lease_until > now:
            return CacheReply.WAIT
        if entry is not None and entry.holder != request_id:
            self._drop_reservation(mm_hash, expired=True)
            entry = None
        if entry is None:
            self.entries[mm_hash] = CacheEntry(holder=request_id, lease_until=now + self.lease_s)
            self._by_request.setdefault(request_id, {})[mm_hash] = None
            self.misses += 1
        else:
            entry.lease_until = now + self.lease_s
        return CacheReply.COMPUTE

    def renew(self, request_id: str, now: float) -> int:
        """Extend every reservation ``request_id`` holds; how many it holds."""
        held = self._by_request.get(request_id, {})
        for h in held:
            self.entries[h].lease_until = now + self.lease_s
        return len(held)

    def expire(self, now: float) -> list[str]:
        """Drop reservations whose lease ran out (their holder died or hung); the hashes dropped."""
        gone = [h for h, e in self.entries.items() if e.meta is None and e.lease_until <= now]
        for h in gone:
            self._drop_reservation(h, expired=True)
        return gone

    def commit(self, mm_hash: str, meta: EmbeddingMeta) -> None:
        """Fill a reservation, evicting the least recently used entries to fit it (charged
        ``meta.cache_charge``: its embeddings times the LLM-width rows each carries)."""
        entry = self.entries.get(mm_hash)
        if entry is None:
            raise KeyError(f"commit of {mm_hash}: no reservation (released, expired or never made)")
        if entry.committed:
            raise KeyError(f"commit of {mm_hash}: committed already")
        charge = meta.cache_charge
        if charge > self.capacity:
            raise EncoderCacheFull(
                f"item {mm_hash[:16]} needs {charge} embeddings of cache, more than the cache shard's "
                f"capacity of {self.capacity}"
            )
        while self.num_free < charge:
            self._evict_oldest()
        self._forget_holder(mm_hash, entry)
        entry.meta, entry.num_embeds = meta, charge
        self.used += charge
        self._lru[mm_hash] = charge

    def release(self, request_id: str) -> list[str]:
        """Drop every reservation ``request_id`` still holds (its compute failed or its client left)."""
        held = list(self._by_request.get(request_id, {}))
        for h in held:
            self._drop_reservation(h)
        return held

    def cancel(self, mm_hash: str) -> None:
        """Drop one reservation (its result will not be cached)."""
        if self.is_reserved(mm_hash):
            self._drop_reservation(mm_hash)

    def invalidate(self, mm_hash: str) -> bool:
        """Drop a committed entry whose tensor is lost; its space is free at once. Not an eviction and
        not queued in ``take_freed``: the caller drops the ref itself. A reservation is left alone
        (False): its computing request will commit a fresh tensor, or release and drop it."""
        entry = self.entries.get(mm_hash)
        if entry is None or not entry.committed:
            return False
        del self.entries[mm_hash]
        del self._lru[mm_hash]
        self.used -= entry.num_embeds
        self.invalidations += 1
        return True

    def take_freed(self) -> list[str]:
        """Hashes evicted since the last call (their tensors can be dropped)."""
        freed, self._freed = self._freed, []
        return freed

    def _evict_oldest(self) -> None:
        mm_hash, size = self._lru.popitem(last=False)
        del self.entries[mm_hash]
        self.used -= size
        self.evictions += 1
        self._freed.append(mm_hash)

    def _drop_reservation(self, mm_hash: str, expired: bool = False) -> None:
        entry = self.entries.pop(mm_hash)
        self._forget_holder(mm_hash, entry)
        self.expired += expired

    def _forget_holder(self, mm_hash: str, entry: CacheEntry) -> None:
        if entry.holder is None:
            return
        held = self._by_request.get(entry.holder)
        if held is not None:
            held.pop(mm_hash, None)
            if not held:
                del self._by_request[entry.holder]
        entry.holder = None

    def stats(self) -> dict[str, int]:
        return {
            "capacity": self.capacity,
            "used": self.used,
            "entries": len(self.entries),
            "reserved": self.num_reserved,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "expired": self.expired,
        }
