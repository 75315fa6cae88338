"""The shared encoder cache: ``EncoderCacheBooks`` in N Ray actors sharded by mm_hash, tensors in Ray's
object store. Every preprocessor, encoder and LLM replica on any node talks to the same shards
through ``EncoderCacheClient``.

One call per shard per request on the way in: ``lookup_or_reserve`` answers each hash with a hit
(meta and ref; the request keeps the ref itself, nothing is pinned), a reservation for this request
(``"compute"``) or ``"wait"`` (another live request is computing it: ``get_or_reserve`` it after
computing your own, so no two requests wait on each other). The encoder replica commits a step's
outputs with one ``commit_many`` per shard. A reservation is leased: its holder renews it while it
computes; a dead holder's reservation is freeable when the lease runs out.

Object refs cross the actor boundary wrapped in a one-element list so Ray does not resolve them; the
shard keeps the ref until the entry is evicted, and remembers evicted refs for ``evict_grace_s`` so
their owner keeps them alive for the requests that looked them up just before (``holding``).
Ray (>= 2.56) has no ``ray.put(_owner=...)``: the replica that puts an embedding owns it, so when that
replica dies its entries' objects are lost. Two ways out of the index for such entries (``invalidate``):

  reactive   the LLM replica gets ``OwnerDiedError`` (an ``ObjectLostError``) fetching a ref and names
             the lost hashes; the router invalidates them (only if they still hold the ref it saw)
             and re-encodes: a lost object is a miss.
  proactive  an encoder replica shutting down gracefully invalidates the (hash, ref) pairs it owns.
             A pair whose hash is still only reserved is remembered as doomed: the commit of that ref,
             which may arrive just after, drops the entry.

A shard that dies is restarted by Ray (``max_restarts``) or, if it is gone for good, re-created by the
first client that finds it dead; either way it comes back empty: its entries are misses, and no
reservation of the old incarnation can be left behind. A call that failed on the dead shard is
retried once on the new one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from encoder_service.encoder_cache import COMPUTE, DEFAULT_LEASE_S, HIT, WAIT, EncoderCacheBooks
from encoder_service.errors import EncoderCacheBusy, EncoderCacheFull
from encoder_service.types import EmbeddingMeta
from encoder_service.uuid_aliases import MAX_ALIASES, UuidAliases

logger = logging.getLogger("mmserve.encoder")

RELEASED = "released"
__all__ = ["COMPUTE", "HIT", "RELEASED", "WAIT", "EncoderCacheClient", "create_cache_index"]
MAX_RELEASED_IDS = 65536  # request ids remembered as released, per shard (ids are never reused)
MAX_DOOMED_REFS = 4096  # refs invalidated before their commit arrived, remembered per shard
MAX_RECENT_EVICTED = 65536
EVICT_GRACE_S = 60.0  # an evicted ref is still reported as held this long (requests may hold it)

Payload = tuple[bytes, list[Any]]  # (meta msgpack, [ObjectRef])
Commit = tuple[str, bytes, list[Any], "str | None"]  # (mm_hash, meta msgpack, [ref], reserving request)


class RequestReleased(RuntimeError):
    """The request's reservations were released (its client left) while this call waited."""


def ref_id(ref: Any) -> str:
    """An ObjectRef's id, comparable across processes without resolving the object."""
    return str(ref.hex())


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
    ) -> None:
        self.books = EncoderCacheBooks(capacity, lease_s)
        self.refs: dict[str, list[Any]] = {}  # mm_hash -> [ObjectRef]
        self.wait_timeout_s = wait_timeout_s
        self.evict_grace_s = evict_grace_s
        self._changed = asyncio.Condition()
        self._doomed: dict[str, None] = {}  # ref ids invalidated while their hash was reserved
        self._released: dict[str, None] = {}  # request ids released, oldest first (bounded)
        self._recent: OrderedDict[str, tuple[str, float]] = OrderedDict()  # evicted -> (ref id, when)
        self.aliases = UuidAliases(max_aliases)  # uuid names whose key hashes to this shard

    def _hit(self, mm_hash: str) -> Payload:
        meta = self.books.entries[mm_hash].meta
        assert meta is not None
        return meta.to_msgpack(), self.refs[mm_hash]

    async def lookup_many(self, hashes: list[str]) -> dict[str, Payload]:
        """A peek at the committed entries among ``hashes`` (not counted, nothing reserved)."""
        return {h: self._hit(h) for h in hashes if self.books.lookup(h, count=False) is not None}

    async def lookup_or_reserve(self, request_id: str, hashes: list[str]) -> dict[str, tuple[str, Any]]:
        """Without waiting, per hash: ``("hit", (meta, [ref]))``, ``("compute", None)`` (reserved for
        ``request_id``) or ``("wait", None)``. A released request gets ``("released", None)``."""
        if request_id in self._released:
            return {h: (RELEASED, None) for h in hashes}
        now = time.monotonic()
        out: dict[str, tuple[str, Any]] = {}
        for h in hashes:
            kind = self.books.lookup_or_reserve(request_id, h, now)
            out[h] = (kind, self._hit(h) if kind == HIT else None)
        return out

    async def get_or_reserve(self, request_id: str, mm_hash: str) -> tuple[str, Any]:
        """Wait (bounded) while another live request computes ``mm_hash``; then ``("hit", ...)`` or
        ``("compute", None)`` (its computation failed or its lease ran out: ours now)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_timeout_s
        async with self._changed:
            while True:
                if request_id in self._released:
                    return RELEASED, None  # its client left while this call waited
                kind = self.books.lookup_or_reserve(request_id, mm_hash, time.monotonic())
                if kind != WAIT:
                    return kind, self._hit(mm_hash) if kind == HIT else None
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
        self, mm_hash: str, meta_msgpack: bytes, ref: list[Any], request_id: str | None = None
    ) -> bool:
        return (await self.commit_many([(mm_hash, meta_msgpack, ref, request_id)]))[0]

    def _commit(self, mm_hash: str, meta_msgpack: bytes, ref: list[Any], request_id: str | None) -> bool:
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
        evicted with that ref less than ``evict_grace_s`` ago."""
        self._trim_recent(time.monotonic())
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
        waiting here (its client left meanwhile) return ``"released"`` instead of reserving later."""
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

    async def alias_point(self, aliases: dict[str, str]) -> None:
        self.aliases.point(aliases)

    async def stats(self) -> dict[str, Any]:
        async with self._changed:
            if self.books.expire(time.monotonic()):
                self._changed.notify_all()
        return {
            **self.books.stats(),
            "invalidations": self.books.invalidations,
            "uuid_names": len(self.aliases),
        }


@dataclass(frozen=True)
class ShardSpec:
    """How to create (or find) the shards: a client re-creates a shard that died for good."""

    name_prefix: str
    capacity_per_shard: int
    wait_timeout_s: float = 30.0
    lease_s: float = DEFAULT_LEASE_S
    detached: bool = False
    namespace: str | None = None
    num_cpus: float = 0.05

    def create(self, index: int) -> Any:
        opts: dict[str, Any] = {
            "name": f"{self.name_prefix}-{index}",
            "get_if_exists": True,
            "num_cpus": self.num_cpus,
            "max_concurrency": 1000,
            "max_restarts": -1,  # a crashed shard comes back empty (its entries become misses)
            # Never inside the caller's placement group: created from an encoder replica whose TP
            # group has one, the shards would take its ranks' CPU and die with that replica.
            "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=None),
        }
        if self.detached:
            opts["lifetime"] = "detached"
        if self.namespace is not None:
            opts["namespace"] = self.namespace
        return (
            ray.remote(CacheIndexShard)
            .options(**opts)
            .remote(self.capacity_per_shard, self.wait_timeout_s, self.lease_s)
        )


class EncoderCacheClient:
    """Async client over the shard actors; cheap to build, picklable (actor handles and the spec)."""

    def __init__(self, shard_actor_handles: list[Any], spec: ShardSpec | None = None) -> None:
        if not shard_actor_handles:
            raise ValueError("need at least one cache index shard")
        self.shards = list(shard_actor_handles)
        self.spec = spec

    @property
    def shard_capacity(self) -> int | None:
        return None if self.spec is None else self.spec.capacity_per_shard

    def shard(self, mm_hash: str) -> Any:
        return self.shards[shard_of(mm_hash, len(self.shards))]

    async def _call(self, index: int, method: str, *args: Any) -> Any:
        """``shards[index].method(*args)``, once more on a new incarnation if the shard died."""
        handle = self.shards[index]
        try:
            return await getattr(handle, method).remote(*args)
        except (ActorDiedError, ActorUnavailableError) as e:
            if self.spec is None:
                raise
            logger.warning(
                "encoder-cache shard %d died (%s); retrying %s on a new one", index, type(e).__name__, method
            )
        await self._revive(index)
        return await getattr(self.shards[index], method).remote(*args)

    async def _revive(self, index: int, attempts: int = 20) -> None:
        """Wait for Ray to restart the shard, or create it again if it is gone for good (by name:
        every client that finds it dead ends up with the same new actor)."""
        assert self.spec is not None
        for attempt in range(attempts):
            handle = self.spec.create(index)
            try:
                await asyncio.wait_for(handle.__ray_ready__.remote(), 10.0)
            except (ActorDiedError, ActorUnavailableError, TimeoutError):
                await asyncio.sleep(min(0.05 * 2**attempt, 1.0))  # its name is not free yet
                continue
            self.shards[index] = handle
            return
        raise EncoderCacheBusy(f"encoder cache shard {index} did not come back")

    def _groups(self, hashes: Iterable[str]) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = {}
        for h in dict.fromkeys(hashes):
            groups.setdefault(shard_of(h, len(self.shards)), []).append(h)
        return groups

    async def lookup_many(self, hashes: list[str]) -> dict[str, tuple[EmbeddingMeta, Any]]:
        groups = self._groups(hashes)
        answers = await asyncio.gather(*(self._call(s, "lookup_many", hs) for s, hs in groups.items()))
        return {h: (EmbeddingMeta.from_msgpack(m), ref[0]) for ans in answers for h, (m, ref) in ans.items()}

    async def lookup_or_reserve(
        self, request_id: str, hashes: list[str]
    ) -> dict[str, tuple[str, tuple[EmbeddingMeta, Any] | None]]:
        """``CacheIndexShard.lookup_or_reserve`` over the shards of ``hashes`` (one call each)."""
        groups = self._groups(hashes)
        answers = await asyncio.gather(
            *(self._call(s, "lookup_or_reserve", request_id, hs) for s, hs in groups.items())
        )
        out: dict[str, tuple[str, tuple[EmbeddingMeta, Any] | None]] = {}
        for ans in answers:
            for h, (kind, payload) in ans.items():
                if kind == RELEASED:
                    raise RequestReleased(f"request {request_id} was released while looking up {h[:16]}")
                out[h] = (
                    kind,
                    None if payload is None else (EmbeddingMeta.from_msgpack(payload[0]), payload[1][0]),
                )
        return out

    async def get_or_reserve(
        self, request_id: str, mm_hash: str
    ) -> tuple[str, tuple[EmbeddingMeta, Any] | None]:
        """``("hit", (meta, ref))`` or ``("compute", None)``; raises ``EncoderCacheBusy`` past the wait."""
        try:
            kind, payload = await self._call(
                shard_of(mm_hash, len(self.shards)), "get_or_reserve", request_id, mm_hash
            )
        except Exception as e:  # Ray wraps actor errors; map ours back to MediaErrors
            cause = getattr(e, "cause", None) or e
            if isinstance(cause, TimeoutError):
                raise EncoderCacheBusy(f"encoder cache: {cause}") from e
            raise
        if kind == HIT:
            meta, ref = payload
            return HIT, (EmbeddingMeta.from_msgpack(meta), ref[0])
        if kind == RELEASED:
            raise RequestReleased(f"request {request_id} was released while waiting for {mm_hash[:16]}")
        return COMPUTE, None

    async def renew(self, request_id: str, hashes: Iterable[str]) -> None:
        await asyncio.gather(*(self._call(s, "renew", request_id) for s in self._groups(hashes)))

    async def commit_many(self, commits: list[tuple[EmbeddingMeta, Any, str | None]]) -> list[bool]:
        """Commit ``(meta, ref, reserving request id)`` items, one call per shard; per item whether it
        is now cached (see ``CacheIndexShard.commit_many``)."""
        groups: dict[int, list[int]] = {}
        for i, (meta, _, _) in enumerate(commits):
            groups.setdefault(shard_of(meta.mm_hash, len(self.shards)), []).append(i)
        answers = await asyncio.gather(
            *(
                self._call(
                    s,
                    "commit_many",
                    [
                        (commits[i][0].mm_hash, commits[i][0].to_msgpack(), [commits[i][1]], commits[i][2])
                        for i in idx
                    ],
                )
                for s, idx in groups.items()
            )
        )
        done = [False] * len(commits)
        for idx, ans in zip(groups.values(), answers, strict=True):
            for i, ok in zip(idx, ans, strict=True):
                done[i] = bool(ok)
        return done

    async def commit(
        self, mm_hash: str, meta: EmbeddingMeta, ref: Any, request_id: str | None = None
    ) -> bool:
        if meta.mm_hash != mm_hash:
            raise ValueError(f"commit of {mm_hash[:16]} with the meta of {meta.mm_hash[:16]}")
        return (await self.commit_many([(meta, ref, request_id)]))[0]

    async def invalidate(
        self, mm_hashes: Iterable[str], ref_ids: Mapping[str, str] | None = None
    ) -> list[str]:
        """Drop the committed entries of ``mm_hashes`` (their objects are lost); returns those dropped.

        ``ref_ids`` (mm_hash -> ``ref_id`` of the ref the caller saw) makes it conditional: an entry
        is only dropped while it still holds that ref.
        """
        groups: dict[int, dict[str, str | None]] = {}
        for h in dict.fromkeys(mm_hashes):
            rid = None if ref_ids is None else ref_ids.get(h)
            groups.setdefault(shard_of(h, len(self.shards)), {})[h] = rid
        answers = await asyncio.gather(*(self._call(s, "invalidate", g) for s, g in groups.items()))
        return [h for dropped in answers for h in dropped]

    async def holding(self, ref_ids: Mapping[str, str]) -> list[str]:
        """Of ``{mm_hash: ref id}``, the hashes the index still holds with that ref (or whose commit
        is still pending, or evicted within the grace period): what an owner must keep alive."""
        groups: dict[int, dict[str, str]] = {}
        for h, rid in ref_ids.items():
            groups.setdefault(shard_of(h, len(self.shards)), {})[h] = rid
        answers = await asyncio.gather(*(self._call(s, "holding", g) for s, g in groups.items()))
        return [h for held in answers for h in held]

    async def release(self, request_id: str, hashes: Iterable[str] | None = None) -> None:
        """Drop the reservations ``request_id`` holds (failure, disconnect): on the shards of ``hashes``
        when the caller knows which it touched, else on every shard. Final for that request id."""
        indexes = range(len(self.shards)) if hashes is None else list(self._groups(hashes))
        await asyncio.gather(*(self._call(s, "release", request_id) for s in indexes))

    # ---- uuid names (encoder_service.uuid_aliases.AliasStore): each on the shard its key hashes to ----
    async def resolve(self, keys: list[str]) -> dict[str, str]:
        groups = self._groups(keys)
        answers = await asyncio.gather(*(self._call(s, "alias_resolve", ks) for s, ks in groups.items()))
        return {k: h for ans in answers for k, h in ans.items()}

    async def point(self, aliases: Mapping[str, str]) -> None:
        groups: dict[int, dict[str, str]] = {}
        for key, mm_hash in aliases.items():
            groups.setdefault(shard_of(key, len(self.shards)), {})[key] = mm_hash
        await asyncio.gather(*(self._call(s, "alias_point", g) for s, g in groups.items()))

    async def stats(self) -> dict[str, Any]:
        per_shard = await asyncio.gather(*(self._call(s, "stats") for s in range(len(self.shards))))
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
    lease_s: float = DEFAULT_LEASE_S,
    largest_item: int = 0,
) -> EncoderCacheClient:
    """Create (or get, if they exist) ``num_shards`` named actors. ``capacity`` is split evenly among
    them, but each shard gets at least ``largest_item``: an item lives in one shard, so every item the
    budgets admit must fit any shard."""
    per_shard = max(1, -(-capacity // num_shards), largest_item)
    spec = ShardSpec(name_prefix, per_shard, wait_timeout_s, lease_s, detached, namespace, num_cpus)
    return EncoderCacheClient([spec.create(i) for i in range(num_shards)], spec)
