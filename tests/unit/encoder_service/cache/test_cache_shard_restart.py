"""A restarted cache shard does not make the owners free embeddings still in flight.

Ray restarts a crashed shard by running ``CacheIndexShard.__init__`` again: the new incarnation is
empty. A request that looked an entry up just before the crash still reads that entry's ref, so the
encoder replica that owns it must keep it as long as it would after an eviction (``evict_grace_s``),
not drop it at its next sweep. No Ray: the shard's books and the owner's sweep are plain Python.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping

from encoder_service.cache.cache_index import CacheIndexShard
from encoder_service.cache.encoder_cache import CacheReply
from encoder_service.cache.owned_embeddings import OwnedEmbeddings
from encoder_service.types import EmbeddingMeta

A, B = "a" * 64, "b" * 64
GRACE_S = 0.3


class Ref:  # stands in for an ObjectRef: the shard only needs .hex()
    def __init__(self, name: str) -> None:
        self.name = name

    def hex(self) -> str:
        return self.name


class OneShardIndex:
    """The owner's view of the index (``OwnedIndex``): one shard, whichever incarnation is up."""

    def __init__(self) -> None:
        self.shard = CacheIndexShard(100, evict_grace_s=GRACE_S)

    def restart(self) -> None:
        self.shard = CacheIndexShard(100, evict_grace_s=GRACE_S)  # what Ray's restart runs: empty

    async def holding(self, ref_ids: Mapping[str, str]) -> list[str]:
        return await self.shard.holding(dict(ref_ids))

    async def invalidate(
        self, mm_hashes: Iterable[str], ref_ids: Mapping[str, str] | None = None
    ) -> list[str]:
        raise AssertionError("not called here")


async def _encode(shard: CacheIndexShard, owned: OwnedEmbeddings, mm_hash: str, ref: Ref) -> None:
    """An encoder replica computes ``mm_hash``: reserve, put (owned), commit."""
    assert (await shard.lookup_or_reserve("enc", [mm_hash]))[mm_hash][0] == CacheReply.COMPUTE
    owned.add(mm_hash, ref)
    meta = EmbeddingMeta(mm_hash, "image", 4, 8, "float32", (1, 2, 2)).to_msgpack()
    assert await shard.commit(mm_hash, meta, [ref], "enc")


def test_a_shard_restart_keeps_in_flight_embeddings_until_the_grace_after_its_start() -> None:
    async def scenario() -> None:
        index = OneShardIndex()
        owned = OwnedEmbeddings(index)
        await _encode(index.shard, owned, A, Ref("ra"))
        await asyncio.sleep(GRACE_S + 0.05)  # well into the first incarnation's life
        assert await owned.sweep() == 0 and len(owned) == 1
        kind, payload = (await index.shard.lookup_or_reserve("llm-request", [A]))[A]
        assert kind == CacheReply.HIT and payload is not None and payload[1][0].hex() == "ra"
        # ... the LLM replica now reads ra; the shard crashes and Ray restarts it, empty
        index.restart()
        assert await index.shard.lookup_many([A]) == {}  # a miss in the new incarnation
        assert await owned.sweep() == 0 and len(owned) == 1  # ra is still readable
        await _encode(index.shard, owned, B, Ref("rb"))  # the new incarnation's own entry
        await asyncio.sleep(GRACE_S + 0.05)
        # past the grace: the pre-crash ref goes as an evicted one would, the new entry stays
        assert await owned.sweep() == 1
        assert await index.holding({A: "ra", B: "rb"}) == [B] and len(owned) == 1

    asyncio.run(scenario())


def test_within_the_start_grace_every_ref_asked_about_is_held() -> None:
    async def scenario() -> None:
        shard = CacheIndexShard(100, evict_grace_s=60.0)
        assert sorted(await shard.holding({A: "ra", B: "anything"})) == [A, B]
        shard = CacheIndexShard(100, evict_grace_s=60.0, start_grace_s=0.0)
        assert await shard.holding({A: "ra", B: "anything"}) == []

    asyncio.run(scenario())
