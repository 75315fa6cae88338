"""The embeddings one encoder replica owns, held alive while the shared cache index still serves them.

Ray has no ``ray.put(_owner=...)``: the replica that puts an embedding owns it, and the object lives
while the owner or a registered borrower holds a ref. Borrowing alone is not enough here: the ref
travels replica → Serve response → ingress → cache shard and LLM replica, and under load Ray's
borrower protocol lost track of such nested refs (the reader got ``ReferenceCountingAssertionError``,
"object already deleted", with the cache entry still present). So the owner itself keeps a strong
ref to everything it put until the index no longer holds it::

    put ──▶ held here ──sweep: index still holds this ref (its commit pending, or evicted less
                      │         than the index's grace period ago: requests may hold it, or its
                      │         shard restarted less than that ago: it came back empty)?──▶ keep
                      └─────────────────────────────── no (evicted long ago, invalidated) ──▶ drop

A sweep runs every ``sweep_interval_s``; between sweeps the extra object-store use is what was
evicted meanwhile. ``max_held`` bounds it if the index cannot be reached (the oldest fall back to
borrowing). On graceful shutdown ``invalidate_all`` removes this replica's entries from the index,
since its objects die with it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Protocol

from encoder_service.cache.cache_index import ref_id

logger = logging.getLogger("mmserve.encoder")

MAX_HELD = 65536
SWEEP_INTERVAL_S = 5.0
SHUTDOWN_INVALIDATE_TIMEOUT_S = 5.0  # well inside Serve's graceful_shutdown_timeout_s (20 s default)


class OwnedIndex(Protocol):
    """What keeping owned embeddings needs of the shared index (``cache_client.EncoderCacheClient``)."""

    async def holding(self, ref_ids: Mapping[str, str]) -> list[str]: ...

    async def invalidate(
        self, mm_hashes: Iterable[str], ref_ids: Mapping[str, str] | None = None
    ) -> list[str]: ...


class OwnedEmbeddings:
    def __init__(self, cache: OwnedIndex | None, max_held: int = MAX_HELD) -> None:
        self.cache = cache  # None: no shared index, nothing to keep alive for
        self.max_held = max_held
        self._refs: OrderedDict[str, object] = OrderedDict()  # mm_hash -> ObjectRef this replica put

    def __len__(self) -> int:
        return len(self._refs)

    def add(self, mm_hash: str, ref: object) -> None:
        if self.cache is None:
            return
        self._refs[mm_hash] = ref
        self._refs.move_to_end(mm_hash)
        while len(self._refs) > self.max_held:
            self._refs.popitem(last=False)

    def _ids(self) -> dict[str, str]:
        return {h: ref_id(r) for h, r in self._refs.items()}

    async def sweep(self) -> int:
        """Drop the refs the index no longer holds; the number dropped. Never raises."""
        if self.cache is None or not self._refs:
            return 0
        ids = self._ids()
        try:
            held = set(await self.cache.holding(ids))
        except Exception as e:  # keep everything; the next sweep retries
            logger.warning("encoder-cache sweep of %d owned embeddings failed: %r", len(ids), e)
            return 0
        dropped = 0
        for h, rid in ids.items():
            if h not in held and h in self._refs and ref_id(self._refs[h]) == rid:
                del self._refs[h]
                dropped += 1
        return dropped

    async def sweep_forever(self, interval_s: float = SWEEP_INTERVAL_S) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.sweep()

    async def invalidate_all(self, timeout_s: float = SHUTDOWN_INVALIDATE_TIMEOUT_S) -> int:
        """Drop the index entries holding this replica's objects; the number dropped. Never raises.

        Entries are matched by ref id, so one re-encoded elsewhere since is kept; an entry whose
        commit has not arrived yet is dropped when it does (the shard remembers the doomed ref).
        """
        ids = self._ids()
        if self.cache is None or not ids:
            return 0
        try:  # the refs stay held until the index stops handing them out
            dropped = await asyncio.wait_for(self.cache.invalidate(list(ids), ids), timeout_s)
        except Exception as e:  # best effort: readers still recover from a lost object
            logger.warning("invalidating %d owned encoder-cache entries failed: %r", len(ids), e)
            return 0
        finally:
            self._refs = OrderedDict()
        logger.info("invalidated %d of %d owned encoder-cache entries", len(dropped), len(ids))
        return len(dropped)
