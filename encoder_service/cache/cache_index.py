"""The shared encoder cache: ``EncoderCacheBooks`` in N Ray actors sharded by mm_hash, tensors in Ray's
object store. Every preprocessor, encoder and LLM replica on any node talks to the same shards
through ``cache_client.EncoderCacheClient``.

One call per shard per request on the way in: ``lookup_or_reserve`` answers each hash with a hit
(meta and ref; the request keeps the ref itself, nothing is pinned), a reservation for this request
(``COMPUTE``) or ``WAIT`` (another live request is computing it: ``get_or_reserve`` it after
computing your own, so no two requests wait on each other). The encoder replica commits a step's
outputs with one ``commit_many`` per shard. A reservation is leased: its holder renews it while it
computes; a dead holder's reservation is freeable when the lease runs out.

Object refs cross the actor boundary wrapped in a one-element list so Ray does not resolve them; the
shard keeps the ref until the entry is evicted, and remembers evicted refs for ``evict_grace_s`` so
their owner keeps them alive for the requests that looked them up just before (``holding``).
A shard that (re)starts comes back empty, as if it had just evicted every entry of its predecessor,
which it cannot name: for ``start_grace_s`` (default ``evict_grace_s``) after its start ``holding``
reports every ref asked about as held, so no owner drops a ref a request looked up before the crash.
Ray (>= 2.56) has no ``ray.put(_owner=...)``: the replica that puts an embedding owns it, so when that
replica dies its entries' objects are lost. Two ways out of the index for such entries (``invalidate``):

  reactive   the LLM replica gets ``OwnerDiedError`` (an ``ObjectLostError``) fetching a ref and names
             the lost hashes; the router invalidates them (only if they still hold the ref it saw)
             and re-encodes: a lost object is a miss.
  proactive  an encoder replica shutting down gracefully invalidates the (hash, ref) pairs it owns.
             A pair whose hash is still only reserved is remembered as doomed: the commit of that ref,
             which may arrive just after, drops the entry.

The client, shard creation and recovery are in ``cache_client.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Protocol, cast

from encoder_service.cache.encoder_cache import DEFAULT_LEASE_S, CacheReply, EncoderCacheBooks
from encoder_service.cache.uuid_aliases import MAX_ALIASES, UuidAliases
from encoder_service.preprocess.errors import EncoderCacheFull
from encoder_service.types import EmbeddingMeta

logger = logging.getLogger("mmserve.encoder")

MAX_RELEASED_IDS = 65536  # request ids remembered as released, per shard (ids are never reused)
MAX_DOOMED_REFS = 4096  # refs invalidated before their commit arrived, remembered per shard
MAX_RECENT_EVICTED = 65536
EVICT_GRACE_S = 60.0  # an evicted ref is still reported as held this long (requests may hold it)

# ObjectRefs are ``object`` here: held and handed back, never resolved (``ref_id`` names them).
Payload = tuple[bytes, list[object]]  # (meta msgpack, [ObjectRef])
Answer = tuple[CacheReply, "Payload | None"]  # per hash: the reply, and a hit's payload
Commit = tuple[str, bytes, list[object], "str | None"]  # (mm_hash, meta msgpack, [ref], reserving request)


class RequestReleased(RuntimeError):
    """The request's reservations were released (its client left) while this call waited."""


class ObjectRefLike(Protocol):
    """What ``ref_id`` needs of a Ray ObjectRef (the shard and the records hold refs as ``object``:
    passed through, never resolved here; this module may not import Ray)."""

    def hex(self) -> str: ...


def ref_id(ref: object) -> str:
    """An ObjectRef's id, comparable across processes without resolving the object."""
    return str(cast(ObjectRefLike, ref).hex())


def shard_of(mm_hash: str, num_shards: int) -> int:
    """Stable across processes (the hash is hex), unlike Python's salted ``hash()``."""
    return int(mm_hash[:16], 16) % num_shards


class CacheIndexShard:
    """One shard: the books, the refs, and the waits. An async actor: methods interleave at awaits."""

    def __init__(
        self,
        capacity: int,
        wait_timeout_s: float = 30.0,
        lease_s: float = DEFAULT_LEASE_S,
        evict_grace_s: float = EVICT_GRACE_S,
        max_aliases: int = MAX_ALIASES,
        start_grace_s: float | None = None,
        max_aliases_per_tenant: int | None = None,
    ) -> None:
        self.books = EncoderCacheBooks(capacity, lease_s)
        self.refs: dict[str, list[object]] = {}  # mm_hash -> [ObjectRef]
        self.wait_timeout_s = wait_timeout_s
        self.evict_grace_s = evict_grace_s
        # Ray restarts a crashed shard by running this again: every start may follow a predecessor
        self.start_grace_s = evict_grace_s if start_grace_s is None else start_grace_s
        self.started = time.monotonic()
        self._changed = asyncio.Condition()
        self._doomed: dict[str, None] = {}  # ref ids invalidated while their hash was reserved
        self._released: dict[str, None] = {}  # request ids released, oldest first (bounded)
        self._recent: OrderedDict[str, tuple[str, float]] = OrderedDict()  # evicted -> (ref id, when)
        self.aliases = UuidAliases(max_aliases, max_aliases_per_tenant)  # names whose key hashes here
        self.lookup_calls = 0  # lookup_or_reserve_batch calls, and the requests' lookups they carried
        self.lookup_requests = 0

    def _hit(self, mm_hash: str) -> Payload:
        meta = self.books.entries[mm_hash].meta
        assert meta is not None
        return meta.to_msgpack(), self.refs[mm_hash]

    async def lookup_many(self, hashes: list[str]) -> dict[str, Payload]:
        """A peek at the committed entries among ``hashes`` (not counted, nothing reserved)."""
        return {h: self._hit(h) for h in hashes if self.books.lookup(h, count=False) is not None}

    async def lookup_or_reserve(self, request_id: str, hashes: list[str]) -> dict[str, Answer]:
        """Without waiting, per hash: ``(HIT, (meta, [ref]))``, ``(COMPUTE, None)`` (reserved for
        ``request_id``) or ``(WAIT, None)``. A released request gets ``(RELEASED, None)``."""
        if request_id in self._released:
            return {h: (CacheReply.RELEASED, None) for h in hashes}
        now = time.monotonic()
        out: dict[str, Answer] = {}
        for h in hashes:
            kind = self.books.lookup_or_reserve(request_id, h, now)
            out[h] = (kind, self._hit(h) if kind == CacheReply.HIT else None)
        return out

    async def lookup_or_reserve_batch(self, requests: list[tuple[str, list[str]]]) -> list[dict[str, Answer]]:
        """``lookup_or_reserve`` for each ``(request_id, hashes)``, in order: one call for the lookups
        of many requests (the client coalesces those made while one is in flight)."""
        self.lookup_calls += 1
        self.lookup_requests += len(requests)
        return [await self.lookup_or_reserve(rid, hashes) for rid, hashes in requests]

    async def get_or_reserve(self, request_id: str, mm_hash: str) -> Answer:
        """Wait (bounded) while another live request computes ``mm_hash``; then ``(HIT, ...)`` or
        ``(COMPUTE, None)`` (its computation failed or its lease ran out: ours now)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_timeout_s
        async with self._changed:
            while True:
                if request_id in self._released:
                    return CacheReply.RELEASED, None  # its client left while this call waited
                kind = self.books.lookup_or_reserve(request_id, mm_hash, time.monotonic())
                if kind != CacheReply.WAIT:
                    return kind, self._hit(mm_hash) if kind == CacheReply.HIT else None
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise TimeoutError(
                        f"waited {self.wait_timeout_s}s for {mm_hash[:16]}: its computation did not commit"
                    )
                lease_left = (self.books.lease_deadline(mm_hash) or 0.0) - time.monotonic()
                try:  # wake at the holder's lease end too: a dead holder never notifies
                    await asyncio.wait_for(self._changed.wait(), max(0.01, min(remaining, lease_left)))
                except TimeoutError:
                    continue

    async def renew(self, request_id: str) -> int:
        """The holder is alive and still computing: extend its reservations' lease."""
        return self.books.renew(request_id, time.monotonic())

    async def commit_many(self, commits: list[Commit]) -> list[bool]:
        """Fill reservations; per item False if its ref was invalidated already (the entry is dropped),
        if it is larger than this shard, or, with a request id, if the reservation is no longer that
        request's (released or expired, and maybe taken over): then that entry is left as it is."""
        async with self._changed:
            done = [self._commit(*c) for c in commits]
            self._drop_freed()
            self._changed.notify_all()
            return done

    async def commit(
        self, mm_hash: str, meta_msgpack: bytes, ref: list[object], request_id: str | None = None
    ) -> bool:
        return (await self.commit_many([(mm_hash, meta_msgpack, ref, request_id)]))[0]

    def _commit(self, mm_hash: str, meta_msgpack: bytes, ref: list[object], request_id: str | None) -> bool:
        entry = self.books.entries.get(mm_hash)
        if entry is None or entry.committed or (request_id is not None and entry.holder != request_id):
            return False
        rid = ref_id(ref[0])
        if rid in self._doomed:
            del self._doomed[rid]
            self.books.cancel(mm_hash)
            return False
        try:
            self.books.commit(mm_hash, EmbeddingMeta.from_msgpack(meta_msgpack))
        except EncoderCacheFull as e:
            logger.warning("not caching %s: %s", mm_hash[:16], e)
            self.books.cancel(mm_hash)
            return False
        self.refs[mm_hash] = ref
        return True

    async def invalidate(self, expected: dict[str, str | None]) -> list[str]:
        """Drop committed entries whose objects are lost: ``{mm_hash: ref id or None}``.

        With a ref id, the entry is dropped only if it still holds that ref (a newer entry computed
        after the loss is kept), and a hash that is only reserved dooms that ref's coming commit.
        With None, the committed entry is dropped whatever it holds. Returns the dropped hashes.
        """
        async with self._changed:
            dropped = []
            for mm_hash, rid in expected.items():
                if rid is not None:
                    self._recent.pop(mm_hash, None)
                if rid is not None and self.books.is_reserved(mm_hash):
                    self._doom(rid)
                    continue
                held = self.refs.get(mm_hash)
                if rid is not None and (held is None or ref_id(held[0]) != rid):
                    continue
                if self.books.invalidate(mm_hash):
                    self.refs.pop(mm_hash, None)
                    dropped.append(mm_hash)
            return dropped

    async def holding(self, expected: dict[str, str]) -> list[str]:
        """Of ``{mm_hash: ref id}``, the hashes whose entry holds that ref, awaits its commit, or was
        evicted with that ref less than ``evict_grace_s`` ago; every one within ``start_grace_s`` of
        this shard's start (a predecessor's entries, evicted by its crash, are unknown here)."""
        now = time.monotonic()
        if now - self.started < self.start_grace_s:
            return list(expected)
        self._trim_recent(now)
        out = []
        for mm_hash, rid in expected.items():
            recent = self._recent.get(mm_hash)
            if recent is not None and recent[0] == rid:
                out.append(mm_hash)
                continue
            if mm_hash not in self.books.entries:
                continue
            held = self.refs.get(mm_hash)
            if held is None or ref_id(held[0]) == rid:
                out.append(mm_hash)
        return out

    def _doom(self, rid: str) -> None:
        self._doomed[rid] = None
        while len(self._doomed) > MAX_DOOMED_REFS:
            del self._doomed[next(iter(self._doomed))]

    async def release(self, request_id: str) -> list[str]:
        """Drop every reservation ``request_id`` holds. Final: its ``get_or_reserve`` calls still
        waiting here (its client left meanwhile) return ``RELEASED`` instead of reserving later."""
        async with self._changed:
            self._released[request_id] = None
            while len(self._released) > MAX_RELEASED_IDS:
                del self._released[next(iter(self._released))]
            dropped = self.books.release(request_id)
            if dropped:
                self._changed.notify_all()
            return dropped

    def _drop_freed(self) -> None:
        now = time.monotonic()
        for h in self.books.take_freed():
            ref = self.refs.pop(h, None)
            if ref is not None:
                self._recent[h] = (ref_id(ref[0]), now)
                self._recent.move_to_end(h)
        self._trim_recent(now)

    def _trim_recent(self, now: float) -> None:
        while self._recent and (
            len(self._recent) > MAX_RECENT_EVICTED
            or next(iter(self._recent.values()))[1] < now - self.evict_grace_s
        ):
            self._recent.popitem(last=False)

    async def alias_resolve(self, keys: list[str]) -> dict[str, str]:
        return self.aliases.resolve(keys)

    async def alias_point(self, aliases: dict[str, str], tenant: str | None = None) -> None:
        self.aliases.point(aliases, tenant)

    async def stats(self) -> dict[str, int]:
        async with self._changed:
            if self.books.expire(time.monotonic()):
                self._changed.notify_all()
        return {
            **self.books.stats(),
            "invalidations": self.books.invalidations,
            "uuid_names": len(self.aliases),
            "lookup_calls": self.lookup_calls,
            "lookup_requests": self.lookup_requests,
        }
