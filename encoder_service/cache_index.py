"""The shared encoder cache: ``EncoderCacheBooks`` in N Ray actors sharded by mm_hash, tensors in Ray's
object store. Every encoder and LLM replica on any node talks to the same shards through
``EncoderCacheClient``.

Single flight: the first ``get_or_reserve`` of a hash gets ``"compute"`` and a reservation pinned by its
request; concurrent callers wait (bounded) for the ``commit`` and then get ``"hit"``. If the computing
request is released before committing (it failed), its reservation is dropped and one waiter takes
over the compute.

Object refs cross the actor boundary wrapped in a one-element list so Ray does not resolve them; the
shard keeps the ref until the entry is evicted. Ray (>= 2.56) has no ``ray.put(_owner=...)``: the
replica that puts an embedding owns it, so when that replica dies its entries' objects are lost.
Two ways out of the index for such entries (``invalidate``):

  reactive   the LLM replica gets ``OwnerDiedError`` (an ``ObjectLostError``) fetching a ref and names
             the lost hashes; the router invalidates them (only if they still hold the ref it saw)
             and re-encodes: a lost object is a miss.
  proactive  an encoder replica shutting down gracefully invalidates the (hash, ref) pairs it owns.
             A pair whose hash is still only reserved is remembered as doomed: the commit of that ref,
             which may arrive just after (the router commits once ``encode`` returns), drops the entry.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from encoder_service.encoder_cache import EncoderCacheBooks
from encoder_service.errors import EncoderCacheBusy, EncoderCacheFull
from encoder_service.types import EmbeddingMeta

HIT, COMPUTE, RELEASED, WAIT = "hit", "compute", "released", "wait"
MAX_RELEASED_IDS = 65536  # request ids remembered as released, per shard (ids are never reused)
MAX_DOOMED_REFS = 4096  # refs invalidated before their commit arrived, remembered per shard


class RequestReleased(RuntimeError):
    """The request's pins were released (its client left) while this call waited: nothing was pinned."""


def ref_id(ref: Any) -> str:
    """An ObjectRef's id, comparable across processes without resolving the object."""
    return str(ref.hex())


def shard_of(mm_hash: str, num_shards: int) -> int:
    """Stable across processes (the hash is hex), unlike Python's salted ``hash()``."""
    return int(mm_hash[:16], 16) % num_shards


class CacheIndexShard:
    """One shard: the books, the refs, and the waits. An async actor: methods interleave at awaits."""

    def __init__(self, capacity: int, wait_timeout_s: float = 30.0) -> None:
        self.books = EncoderCacheBooks(capacity)
        self.refs: dict[str, list[Any]] = {}  # mm_hash -> [ObjectRef]
        self.wait_timeout_s = wait_timeout_s
        self._changed = asyncio.Condition()
        self._doomed: dict[str, None] = {}  # ref ids invalidated while their hash was reserved
        self._released: dict[str, None] = {}  # request ids released, oldest first (bounded)

    async def lookup_many(self, hashes: list[str]) -> dict[str, tuple[bytes, list[Any]]]:
        out = {}
        for h in hashes:
            meta = self.books.lookup(h, count=False)  # a peek: get_or_reserve counts the decision
            if meta is not None:
                out[h] = (meta.to_msgpack(), self.refs[h])
        return out

    async def pin_committed(self, request_id: str, hashes: list[str]) -> dict[str, tuple[bytes, list[Any]]]:
        """Pin for ``request_id`` and return the committed entries among ``hashes`` (each counts as a
        hit); the others are not counted here: ``acquire`` decides them once they are processed."""
        out: dict[str, tuple[bytes, list[Any]]] = {}
        if request_id in self._released:
            return out
        for h in hashes:
            entry = self.books.entries.get(h)
            if entry is not None and entry.meta is not None:
                self.books.pin(request_id, h)
                self.books.hits += 1
                out[h] = (entry.meta.to_msgpack(), self.refs[h])
        return out

    async def acquire(self, request_id: str, wanted: list[tuple[str, int]]) -> dict[str, tuple[str, Any]]:
        """Without waiting, for each ``(mm_hash, num_embeds)``: ``("hit", (meta, [ref]))`` pinned,
        ``("compute", None)`` reserved for ``request_id``, or ``("wait", None)`` (another request is
        computing it: ask ``get_or_reserve`` after computing yours, so no two requests wait on each
        other). A request released already gets ``("released", None)`` for everything."""
        out: dict[str, tuple[str, Any]] = {}
        async with self._changed:
            for mm_hash, num_embeds in wanted:
                if request_id in self._released:
                    out[mm_hash] = (RELEASED, None)
                    continue
                entry = self.books.entries.get(mm_hash)
                if entry is not None and entry.meta is not None:
                    self.books.pin(request_id, mm_hash)
                    self.books.hits += 1
                    out[mm_hash] = (HIT, (entry.meta.to_msgpack(), self.refs[mm_hash]))
                elif entry is not None:
                    out[mm_hash] = (WAIT, None)
                else:
                    try:
                        reserved = self.books.try_allocate(request_id, mm_hash, num_embeds)
                    except EncoderCacheFull as e:
                        raise ValueError(str(e)) from e
                    if reserved:
                        self._drop_freed()
                        self.books.misses += 1
                        out[mm_hash] = (COMPUTE, None)
                    else:  # every entry is pinned right now: wait for space like get_or_reserve
                        out[mm_hash] = (WAIT, None)
        return out

    async def get_or_reserve(self, request_id: str, mm_hash: str, num_embeds: int) -> tuple[str, Any]:
        """``("hit", (meta_msgpack, [ref]))`` pinned for ``request_id``, or ``("compute", None)`` reserved."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_timeout_s
        async with self._changed:
            while True:
                if request_id in self._released:
                    # Its client left while this call waited: pinning or reserving now would leak.
                    return RELEASED, None
                entry = self.books.entries.get(mm_hash)
                if entry is not None and entry.meta is not None:
                    self.books.pin(request_id, mm_hash)
                    self.books.hits += 1
                    return HIT, (entry.meta.to_msgpack(), self.refs[mm_hash])
                if entry is None:
                    try:
                        reserved = self.books.try_allocate(request_id, mm_hash, num_embeds)
                    except EncoderCacheFull as e:
                        raise ValueError(str(e)) from e
                    if reserved:
                        self._drop_freed()  # now: an evicted hash may be reserved again right after
                        self.books.misses += 1
                        return COMPUTE, None
                remaining = deadline - loop.time()
                if remaining <= 0:
                    why = "its computation did not commit" if entry is not None else "every entry is pinned"
                    raise TimeoutError(f"waited {self.wait_timeout_s}s for {mm_hash[:16]}: {why}")
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except TimeoutError:
                    continue

    async def commit(
        self, mm_hash: str, meta_msgpack: bytes, ref: list[Any], request_id: str | None = None
    ) -> bool:
        """Fill the reservation; False if ``ref`` was invalidated already (the entry is dropped) or,
        with ``request_id``, if the entry is no longer that request's reservation (it was released
        and another request reserved or filled it meanwhile): then nothing changes."""
        async with self._changed:
            entry = self.books.entries.get(mm_hash)
            if request_id is not None and (
                entry is None or entry.meta is not None or request_id not in entry.pins
            ):
                return False
            self.books.commit(mm_hash, EmbeddingMeta.from_msgpack(meta_msgpack))
            rid = ref_id(ref[0])
            doomed = rid in self._doomed
            if doomed:
                del self._doomed[rid]
                self.books.invalidate(mm_hash)
            else:
                self.refs[mm_hash] = ref
            self._drop_freed()
            self._changed.notify_all()
            return not doomed

    async def invalidate(self, expected: dict[str, str | None]) -> list[str]:
        """Drop committed entries whose objects are lost: ``{mm_hash: ref id or None}``.

        With a ref id, the entry is dropped only if it still holds that ref (a newer entry computed
        after the loss is kept), and a hash that is only reserved dooms that ref's coming commit.
        With None, the committed entry is dropped whatever it holds. Returns the dropped hashes.
        """
        async with self._changed:
            dropped = []
            for mm_hash, rid in expected.items():
                if rid is not None and self.books.is_reserved(mm_hash):
                    self._doom(rid)
                    continue
                held = self.refs.get(mm_hash)
                if rid is not None and (held is None or ref_id(held[0]) != rid):
                    continue
                if self.books.invalidate(mm_hash):
                    self.refs.pop(mm_hash, None)
                    dropped.append(mm_hash)
            if dropped:
                self._changed.notify_all()  # space came back: waiters may allocate now
            return dropped

    async def holding(self, expected: dict[str, str]) -> list[str]:
        """Of ``{mm_hash: ref id}``, the hashes whose entry holds that ref or awaits its commit."""
        out = []
        for mm_hash, rid in expected.items():
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
        """Unpin everything ``request_id`` holds. Final: its ``get_or_reserve`` calls still waiting
        here (its client left meanwhile) return ``"released"`` instead of pinning afterwards."""
        async with self._changed:
            self._released[request_id] = None
            while len(self._released) > MAX_RELEASED_IDS:
                del self._released[next(iter(self._released))]
            dropped = self.books.release(request_id)
            self._changed.notify_all()
            return dropped

    def _drop_freed(self) -> None:
        for h in self.books.take_freed():
            self.refs.pop(h, None)

    async def stats(self) -> dict[str, Any]:
        self._drop_freed()
        return {**self.books.stats(), "invalidations": self.books.invalidations}


class EncoderCacheClient:
    """Async client over the shard actors; cheap to build, picklable (holds actor handles only)."""

    def __init__(self, shard_actor_handles: list[Any]) -> None:
        if not shard_actor_handles:
            raise ValueError("need at least one cache index shard")
        self.shards = list(shard_actor_handles)

    def shard(self, mm_hash: str) -> Any:
        return self.shards[shard_of(mm_hash, len(self.shards))]

    async def lookup_many(self, hashes: list[str]) -> dict[str, tuple[EmbeddingMeta, Any]]:
        groups = self._groups(hashes)
        answers = await asyncio.gather(*(self.shards[s].lookup_many.remote(hs) for s, hs in groups.items()))
        return {h: (EmbeddingMeta.from_msgpack(m), ref[0]) for ans in answers for h, (m, ref) in ans.items()}

    def _groups(self, hashes: Iterable[str]) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = {}
        for h in dict.fromkeys(hashes):
            groups.setdefault(shard_of(h, len(self.shards)), []).append(h)
        return groups

    async def pin_committed(self, request_id: str, hashes: list[str]) -> dict[str, tuple[EmbeddingMeta, Any]]:
        """The committed entries among ``hashes``, pinned for ``request_id``: one call per shard."""
        groups = self._groups(hashes)
        answers = await asyncio.gather(
            *(self.shards[s].pin_committed.remote(request_id, hs) for s, hs in groups.items())
        )
        return {h: (EmbeddingMeta.from_msgpack(m), ref[0]) for ans in answers for h, (m, ref) in ans.items()}

    async def acquire(
        self, request_id: str, wanted: Mapping[str, int]
    ) -> dict[str, tuple[str, tuple[EmbeddingMeta, Any] | None]]:
        """``CacheIndexShard.acquire`` over every shard (one call each); raises ``EncoderCacheFull``."""
        groups: dict[int, list[tuple[str, int]]] = {}
        for h, n in wanted.items():
            groups.setdefault(shard_of(h, len(self.shards)), []).append((h, n))
        try:
            answers = await asyncio.gather(
                *(self.shards[s].acquire.remote(request_id, items) for s, items in groups.items())
            )
        except Exception as e:
            cause = getattr(e, "cause", None) or e
            if isinstance(cause, ValueError):
                raise EncoderCacheFull(str(cause)) from e
            raise
        out: dict[str, tuple[str, tuple[EmbeddingMeta, Any] | None]] = {}
        for ans in answers:
            for h, (kind, payload) in ans.items():
                if kind == RELEASED:
                    raise RequestReleased(f"request {request_id} was released while acquiring {h[:16]}")
                out[h] = (
                    kind,
                    None if payload is None else (EmbeddingMeta.from_msgpack(payload[0]), payload[1][0]),
                )
        return out

    async def get_or_reserve(
        self, request_id: str, mm_hash: str, num_embeds: int
    ) -> tuple[str, tuple[EmbeddingMeta, Any] | None]:
        """``("hit", (meta, ref))`` or ``("compute", None)``; raises ``EncoderCacheFull`` / ``EncoderCacheBusy``."""
        try:
            kind, payload = await self.shard(mm_hash).get_or_reserve.remote(request_id, mm_hash, num_embeds)
        except Exception as e:  # Ray wraps actor errors; map the two we raise back to MediaErrors
            cause = getattr(e, "cause", None) or e
            if isinstance(cause, ValueError):
                raise EncoderCacheFull(str(cause)) from e
            if isinstance(cause, TimeoutError):
                raise EncoderCacheBusy(f"encoder cache: {cause}") from e
            raise
        if kind == HIT:
            meta, ref = payload
            return HIT, (EmbeddingMeta.from_msgpack(meta), ref[0])
        if kind == RELEASED:
            raise RequestReleased(f"request {request_id} was released while waiting for {mm_hash[:16]}")
        return COMPUTE, None

    async def commit(
        self, mm_hash: str, meta: EmbeddingMeta, ref: Any, request_id: str | None = None
    ) -> bool:
        """False when ``ref``'s owner already invalidated it (shutting down): the entry was dropped;
        or when the reservation is no longer ``request_id``'s (see ``CacheIndexShard.commit``)."""
        shard = self.shard(mm_hash)
        return bool(await shard.commit.remote(mm_hash, meta.to_msgpack(), [ref], request_id))

    async def invalidate(
        self, mm_hashes: Iterable[str], ref_ids: Mapping[str, str] | None = None
    ) -> list[str]:
        """Drop the committed entries of ``mm_hashes`` (their objects are lost); returns those dropped.

        ``ref_ids`` (mm_hash -> ``ref_id`` of the ref the caller saw) makes it conditional: an entry
        is only dropped while it still holds that ref. Pins of other running requests on a dropped
        entry go with it (see ``EncoderCacheBooks.invalidate``); their release stays a no-op.
        """
        groups: dict[int, dict[str, str | None]] = {}
        for h in dict.fromkeys(mm_hashes):
            rid = None if ref_ids is None else ref_ids.get(h)
            groups.setdefault(shard_of(h, len(self.shards)), {})[h] = rid
        answers = await asyncio.gather(*(self.shards[s].invalidate.remote(g) for s, g in groups.items()))
        return [h for dropped in answers for h in dropped]

    async def holding(self, ref_ids: Mapping[str, str]) -> list[str]:
        """Of ``{mm_hash: ref id}``, the hashes the index still holds with that ref (or whose commit
        is still pending): what an owner must keep alive."""
        groups: dict[int, dict[str, str]] = {}
        for h, rid in ref_ids.items():
            groups.setdefault(shard_of(h, len(self.shards)), {})[h] = rid
        answers = await asyncio.gather(*(self.shards[s].holding.remote(g) for s, g in groups.items()))
        return [h for held in answers for h in held]

    async def release(self, request_id: str, hashes: Iterable[str] | None = None) -> None:
        """Unpin everything ``request_id`` holds (prefill done, failure, disconnect): on the shards of
        ``hashes`` when the caller knows which it touched, else on every shard."""
        shards = self.shards if hashes is None else [self.shards[s] for s in self._groups(hashes)]
        await asyncio.gather(*(s.release.remote(request_id) for s in shards))

    async def stats(self) -> dict[str, Any]:
        per_shard = await asyncio.gather(*(s.stats.remote() for s in self.shards))
        total = {k: sum(int(d[k]) for d in per_shard) for k in per_shard[0]}
        return {**total, "shards": per_shard}


def create_cache_index(
    num_shards: int,
    capacity: int,
    name_prefix: str = "mmserve-encoder-cache",
    *,
    detached: bool = False,
    namespace: str | None = None,
    num_cpus: float = 0.05,
    wait_timeout_s: float = 30.0,
) -> EncoderCacheClient:
    """Create (or get, if they exist) ``num_shards`` named actors; capacity is split evenly among them."""
    actor_cls = ray.remote(CacheIndexShard)
    per_shard = max(1, -(-capacity // num_shards))
    handles = []
    for i in range(num_shards):
        opts: dict[str, Any] = {
            "name": f"{name_prefix}-{i}",
            "get_if_exists": True,
            "num_cpus": num_cpus,
            "max_concurrency": 1000,
            # Never inside the caller's placement group: created from an encoder replica whose TP
            # group has one, the shards would take its ranks' CPU and die with that replica.
            "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=None),
        }
        if detached:
            opts["lifetime"] = "detached"
        if namespace is not None:
            opts["namespace"] = namespace
        handles.append(actor_cls.options(**opts).remote(per_shard, wait_timeout_s))
    return EncoderCacheClient(handles)
