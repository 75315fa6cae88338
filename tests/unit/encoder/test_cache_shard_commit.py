"""A late commit from a request that no longer holds the reservation changes nothing."""

from __future__ import annotations

import asyncio

from encoder_service.cache_index import COMPUTE, HIT, CacheIndexShard
from encoder_service.types import EmbeddingMeta

H = "ab" * 32


class Ref:  # stands in for an ObjectRef: the shard only needs .hex()
    def __init__(self, name: str) -> None:
        self.name = name

    def hex(self) -> str:
        return self.name


def test_commit_only_fills_the_committing_requests_own_reservation() -> None:
    meta = EmbeddingMeta(H, "image", 4, 8, "float32", (1, 4, 4)).to_msgpack()

    async def scenario() -> None:
        shard = CacheIndexShard(100, wait_timeout_s=1.0)
        assert (await shard.get_or_reserve("a", H, 4))[0] == COMPUTE
        await shard.release("a")  # a failed; its encode is still running somewhere
        assert (await shard.get_or_reserve("b", H, 4))[0] == COMPUTE
        assert not await shard.commit(H, meta, [Ref("from-a")], "a")  # a's late commit: refused
        assert shard.books.entries[H].meta is None and H not in shard.refs
        assert await shard.commit(H, meta, [Ref("from-b")], "b")
        assert not await shard.commit(H, meta, [Ref("again")], "b")  # committed already: kept as is
        kind, payload = await shard.get_or_reserve("c", H, 4)
        assert kind == HIT and payload is not None and payload[1][0].hex() == "from-b"

    asyncio.run(scenario())
