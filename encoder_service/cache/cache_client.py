"""The client of the shared encoder cache (``cache_index.CacheIndexShard`` actors): one call per shard a
request touches, grouped by ``shard_of``; the shards' creation (``create_cache_index``, sized so each
holds the largest admitted item) and their recovery.

Who creates the shards is the ``ShardSpec``'s to say: on a bare Ray, the first client (by name:
every client ends up with the same actor); in a Serve application, an owner whose lifetime is the
application's (cluster/cache_shards.py), and clients only find them by name. A shard that dies is
restarted by Ray (``max_restarts``) or, if it is gone for good, re-created (by the first client that
finds it dead, or by its owner); either way it comes back empty: its entries are misses, and no
reservation of the old incarnation can be left behind. A call that failed on the dead shard is
retried once on the new one.

Side channel: with a ``link_to`` factory (the wiring's, e.g. cluster/replica_links.py), the methods in
``LINK_METHODS`` travel on a link to the shard once one is up; without one, every call is an actor
call and the shard never listens.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast

import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from encoder_service.cache.cache_index import Answer, CacheIndexShard, RequestReleased, shard_of
from encoder_service.cache.call_coalescing import CallCoalescer
from encoder_service.cache.encoder_cache import DEFAULT_LEASE_S, CacheReply
from encoder_service.preprocess.errors import EncoderCacheBusy
from encoder_service.preprocess.gathering import gather
from encoder_service.types import EmbeddingMeta

logger = logging.getLogger("mmserve.encoder")

R = TypeVar("R")
Found = tuple[EmbeddingMeta, object]  # a hit: the entry's metadata and its ObjectRef (passed through)
Lookup = tuple[str, list[str]]  # one request's lookup on one shard: (request id, hashes)


# The shard methods a client calls over a side channel (a ``ShardLink``) once one is up: the hot
# path's lookups and the calls that carry no ObjectRef in. ``commit``/``commit_many`` stay actor
# calls: a ref sent into the shard must be a borrow Ray counts, so the index keeps its object alive.
LINK_METHODS = frozenset(
    {
        "lookup_or_reserve_batch",
        "lookup_many",
        "get_or_reserve",
        "renew",
        "release",
        "alias_resolve",
        "alias_point",
    }
)


class ShardLink(Protocol):
    """A side channel to one shard (mmcore/link/direct_link.py's ``DirectLink``): ``call`` raises a
    ``ConnectionError`` when the link is lost, and the client goes on with actor calls."""

    def usable(self) -> bool: ...

    async def call(self, method: str, *args: object) -> object: ...

    def close(self) -> None: ...


LinkTo = Callable[[ActorHandle], ShardLink]  # a shard's actor handle -> a link to it


@dataclass(frozen=True)
class ShardSpec:
    """How to create or find the shards. ``created_by_clients``: a client creates a shard that is not
    there yet, or died for good; else an owner does (cluster/cache_shards.py) and clients wait for it
    by name. ``actor_class``: the shard's actor class (default: the books, with no side channel)."""

    name_prefix: str
    capacity_per_shard: int
    wait_timeout_s: float = 30.0
    lease_s: float = DEFAULT_LEASE_S
    detached: bool = False
    namespace: str | None = None
    num_cpus: float = 0.05
    actor_class: type | None = None
    created_by_clients: bool = True
    uuid_names_per_tenant: int | None = None  # each shard's share of a tenant's quota of uuid names
    resources: tuple[tuple[str, float], ...] = ()  # custom Ray resources: node markers (encoder_node)

    def name(self, index: int) -> str:
        return f"{self.name_prefix}-{index}"

    def open(self, index: int) -> ActorHandle:
        """Shard ``index``'s handle: created (or got) where clients create shards, else found by
        name; ``ValueError`` while there is none."""
        if self.created_by_clients:
            return self.create(index)
        return ray.get_actor(self.name(index), namespace=self.namespace)

    def create(self, index: int) -> ActorHandle:
        opts: dict[str, object] = {
            "name": self.name(index),
            "get_if_exists": True,
            "num_cpus": self.num_cpus,
            "max_concurrency": 1000,
            "max_restarts": -1,  # a crashed shard comes back empty (its entries become misses)
            # Hot path (every media request calls a shard): no per-call task events to the GCS, as
            # Serve does for its replicas (RAY_SERVE_ENABLE_TASK_EVENTS=0).
            "enable_task_events": False,
            # Never inside the caller's placement group: created from an encoder replica whose TP
            # group has one, the shards would take its ranks' CPU and die with that replica.
            "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=None),
        }
        if self.resources:
            opts["resources"] = dict(self.resources)
        if self.detached:
            opts["lifetime"] = "detached"
        if self.namespace is not None:
            opts["namespace"] = self.namespace
        return (
            ray.remote(self.actor_class or CacheIndexShard)
            .options(**opts)
            .remote(
                self.capacity_per_shard,
                self.wait_timeout_s,
                self.lease_s,
                max_aliases_per_tenant=self.uuid_names_per_tenant,
            )
        )


class EncoderCacheClient:
    """Async client over the shard actors; cheap to build, picklable (actor handles, the spec and the
    link factory). A shard whose handle is ``None`` is opened on first use (``ShardSpec.open``)."""

    def __init__(
        self,
        shard_actor_handles: list[ActorHandle | None],
        spec: ShardSpec | None = None,
        link_to: LinkTo | None = None,
    ) -> None:
        if not shard_actor_handles:
            raise ValueError("need at least one cache index shard")
        if spec is None and None in shard_actor_handles:
            raise ValueError("a shard without a handle needs a ShardSpec to open it")
        self.shards: list[ActorHandle | None] = list(shard_actor_handles)
        self.spec = spec
        self.link_to = link_to
        self._lookups: dict[int, CallCoalescer[Lookup, dict[str, Answer]]] = {}
        self._links: dict[int, ShardLink] = {}  # shard index -> this process's link, made on first use

    def __reduce__(self) -> tuple[type[EncoderCacheClient], tuple[object, ...]]:
        return (EncoderCacheClient, (self.shards, self.spec, self.link_to))  # a copy starts its own batches

    def _lookup_batches(self, index: int) -> CallCoalescer[Lookup, dict[str, Answer]]:
        """Shard ``index``'s lookups: one ``lookup_or_reserve_batch`` in flight, the rest queued for
        the next (encoder_service/cache/call_coalescing.py)."""
        if index not in self._lookups:

            async def send(requests: list[Lookup]) -> list[dict[str, Answer]]:
                return await self._call(index, CacheIndexShard.lookup_or_reserve_batch, requests)

            self._lookups[index] = CallCoalescer(send)
        return self._lookups[index]

    @property
    def shard_capacity(self) -> int | None:
        return None if self.spec is None else self.spec.capacity_per_shard

    def _link(self, index: int) -> ShardLink | None:
        if self.link_to is None or self.spec is None:
            return None
        if index not in self._links:
            self._links[index] = self.link_to(self.shards[index])
        return self._links[index]

    async def _call(self, index: int, method: Callable[..., Awaitable[R]], *args: object) -> R:
        """``shards[index].method(*args)``, ``method`` a ``CacheIndexShard`` method (its name is sent,
        its return type is the reply's): a frame on the shard's link where the method allows and the
        link is up; else (and after a lost link) an actor call, once more on a new incarnation if the
        shard died."""
        name = method.__name__
        if self.shards[index] is None:
            await self._revive(index)
        if name in LINK_METHODS and (link := self._link(index)) is not None and link.usable():
            try:
                return cast(R, await link.call(name, *args))  # the shard method's reply, as it returned it
            except (ConnectionError, ActorDiedError, ActorUnavailableError) as e:
                logger.warning("encoder-cache shard %d's link lost (%r); %s as an actor call", index, e, name)
        handle = self.shards[index]
        try:
            return await getattr(handle, name).remote(*args)
        except (ActorDiedError, ActorUnavailableError) as e:
            if self.spec is None:
                raise
            logger.warning(
                "encoder-cache shard %d died (%s); retrying %s on a new one", index, type(e).__name__, name
            )
        await self._revive(index)
        return await getattr(self.shards[index], name).remote(*args)

    async def _revive(self, index: int, attempts: int = 20) -> None:
        """Open shard ``index`` (first use), or after it died: wait for Ray to restart it, or for it
        to be created again if it is gone for good (by name: every client that finds it dead ends up
        with the same new actor)."""
        assert self.spec is not None
        for attempt in range(attempts):
            try:
                handle = self.spec.open(index)
                await asyncio.wait_for(handle.__ray_ready__.remote(), 10.0)
            except (ValueError, ActorDiedError, ActorUnavailableError, TimeoutError):
                await asyncio.sleep(min(0.05 * 2**attempt, 1.0))  # its name is not free (or taken) yet
                continue
            if handle != self.shards[index] and (link := self._links.pop(index, None)) is not None:
                link.close()  # it led to the old incarnation
            self.shards[index] = handle
            return
        raise EncoderCacheBusy(f"encoder cache shard {index} did not come back")

    def _groups(self, hashes: Iterable[str]) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = {}
        for h in dict.fromkeys(hashes):
            groups.setdefault(shard_of(h, len(self.shards)), []).append(h)
        return groups

    async def lookup_many(self, hashes: list[str]) -> dict[str, Found]:
        groups = self._groups(hashes)
        answers = await gather(*(self._call(s, CacheIndexShard.lookup_many, hs) for s, hs in groups.items()))
        return {h: (EmbeddingMeta.from_msgpack(m), ref[0]) for ans in answers for h, (m, ref) in ans.items()}

    async def lookup_or_reserve(
        self, request_id: str, hashes: list[str]
    ) -> dict[str, tuple[CacheReply, Found | None]]:
        """``CacheIndexShard.lookup_or_reserve`` over the shards of ``hashes``: one call each, shared
        with the lookups of other requests made while the shard's last one was in flight."""
        groups = self._groups(hashes)
        answers = await gather(*(self._lookup_batches(s)((request_id, hs)) for s, hs in groups.items()))
        out: dict[str, tuple[CacheReply, Found | None]] = {}
        for ans in answers:
            for h, (kind, payload) in ans.items():
                if kind == CacheReply.RELEASED:
                    raise RequestReleased(f"request {request_id} was released while looking up {h[:16]}")
                out[h] = (
                    kind,
                    None if payload is None else (EmbeddingMeta.from_msgpack(payload[0]), payload[1][0]),
                )
        return out

    async def get_or_reserve(self, request_id: str, mm_hash: str) -> tuple[CacheReply, Found | None]:
        """``(HIT, (meta, ref))`` or ``(COMPUTE, None)``; raises ``EncoderCacheBusy`` past the wait."""
        try:
            kind, payload = await self._call(
                shard_of(mm_hash, len(self.shards)), CacheIndexShard.get_or_reserve, request_id, mm_hash
            )
        except Exception as e:  # Ray wraps actor errors; map ours back to MediaErrors
            cause = getattr(e, "cause", None) or e
            if isinstance(cause, TimeoutError):
                raise EncoderCacheBusy(f"encoder cache: {cause}") from e
            raise
        if kind == CacheReply.HIT:
            assert payload is not None  # a hit carries its entry
            meta, ref = payload
            return CacheReply.HIT, (EmbeddingMeta.from_msgpack(meta), ref[0])
        if kind == CacheReply.RELEASED:
            raise RequestReleased(f"request {request_id} was released while waiting for {mm_hash[:16]}")
        return CacheReply.COMPUTE, None

    async def renew(self, request_id: str, hashes: Iterable[str]) -> None:
        await gather(*(self._call(s, CacheIndexShard.renew, request_id) for s in self._groups(hashes)))

    async def commit_many(self, commits: list[tuple[EmbeddingMeta, object, str | None]]) -> list[bool]:
        """Commit ``(meta, ref, reserving request id)`` items, one call per shard; per item whether it
        is now cached (see ``CacheIndexShard.commit_many``)."""
        groups: dict[int, list[int]] = {}
        for i, (meta, _, _) in enumerate(commits):
            groups.setdefault(shard_of(meta.mm_hash, len(self.shards)), []).append(i)
        answers = await gather(
            *(
                self._call(
                    s,
                    CacheIndexShard.commit_many,
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
        self, mm_hash: str, meta: EmbeddingMeta, ref: object, request_id: str | None = None
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
        answers = await gather(*(self._call(s, CacheIndexShard.invalidate, g) for s, g in groups.items()))
        return [h for dropped in answers for h in dropped]

    async def holding(self, ref_ids: Mapping[str, str]) -> list[str]:
        """Of ``{mm_hash: ref id}``, the hashes the index still holds with that ref (or whose commit
        is still pending, or evicted within the grace period): what an owner must keep alive."""
        groups: dict[int, dict[str, str]] = {}
        for h, rid in ref_ids.items():
            groups.setdefault(shard_of(h, len(self.shards)), {})[h] = rid
        answers = await gather(*(self._call(s, CacheIndexShard.holding, g) for s, g in groups.items()))
        return [h for held in answers for h in held]

    async def release(self, request_id: str, hashes: Iterable[str] | None = None) -> None:
        """Drop the reservations ``request_id`` holds (failure, disconnect): on the shards of ``hashes``
        when the caller knows which it touched, else on every shard. Final for that request id."""
        indexes = range(len(self.shards)) if hashes is None else list(self._groups(hashes))
        await gather(*(self._call(s, CacheIndexShard.release, request_id) for s in indexes))

    # ---- uuid names (encoder_service.cache.uuid_aliases.AliasStore): each on the shard its key hashes to ----
    async def resolve(self, keys: list[str]) -> dict[str, str]:
        groups = self._groups(keys)
        answers = await gather(
            *(self._call(s, CacheIndexShard.alias_resolve, ks) for s, ks in groups.items())
        )
        return {k: h for ans in answers for k, h in ans.items()}

    async def point(self, aliases: Mapping[str, str], tenant: str | None = None) -> None:
        groups: dict[int, dict[str, str]] = {}
        for key, mm_hash in aliases.items():
            groups.setdefault(shard_of(key, len(self.shards)), {})[key] = mm_hash
        await gather(*(self._call(s, CacheIndexShard.alias_point, g, tenant) for s, g in groups.items()))

    async def stats(self) -> dict[str, int | list[dict[str, int]]]:
        per_shard = await gather(*(self._call(s, CacheIndexShard.stats) for s in range(len(self.shards))))
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
    """Create (or get, if they exist) ``num_shards`` named actors, without a side channel (on a bare
    Ray; a Serve application's are cluster/cache_shards.py's). See ``shard_capacity``."""
    per_shard = shard_capacity(num_shards, capacity, largest_item)
    spec = ShardSpec(name_prefix, per_shard, wait_timeout_s, lease_s, detached, namespace, num_cpus)
    return EncoderCacheClient([spec.create(i) for i in range(num_shards)], spec)


def shard_capacity(num_shards: int, capacity: int, largest_item: int = 0) -> int:
    """``capacity`` split evenly among the shards, but at least ``largest_item`` each: an item lives
    in one shard, so every item the budgets admit must fit any shard."""
    return max(1, -(-capacity // num_shards), largest_item)
