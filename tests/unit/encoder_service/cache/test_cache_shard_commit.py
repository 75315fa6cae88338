"""A late commit from a request that no longer holds the reservation changes nothing."""

from __future__ import annotations

import asyncio

from encoder_service.cache.cache_index import CacheIndexShard
from encoder_service.cache.encoder_cache import CacheReply
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
        assert (await shard.get_or_reserve("a", H))[0] == CacheReply.COMPUTE
        await shard.release("a")  # a failed; its encode is still running somewhere
        assert (await shard.get_or_reserve("b", H))[0] == CacheReply.COMPUTE
        assert not await shard.commit(H, meta, [Ref("from-a")], "a")  # a's late commit: refused
        assert shard.books.entries[H].meta is None and H not in shard.refs
        assert await shard.commit(H, meta, [Ref("from-b")], "b")
        assert not await shard.commit(H, meta, [Ref("again")], "b")  # committed already: kept as is
        kind, payload = await shard.get_or_reserve("c", H)
        assert kind == CacheReply.HIT and payload is not None and payload[1][0].hex() == "from-b"

    asyncio.run(scenario())


def _meta(h: str, n: int) -> bytes:
    return EmbeddingMeta(h, "image", n, 8, "float32", (1, 2, 2)).to_msgpack()


def test_a_waiter_takes_over_when_the_holder_dies_without_releasing() -> None:
    async def scenario() -> None:
        shard = CacheIndexShard(100, wait_timeout_s=5.0, lease_s=0.2)
        assert (await shard.lookup_or_reserve("dead", [H]))[H][0] == CacheReply.COMPUTE
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert (await shard.get_or_reserve("b", H))[0] == CacheReply.COMPUTE  # woken by the lease's end
        assert 0.15 < loop.time() - start < 2.0
        assert not await shard.commit(H, _meta(H, 4), [Ref("late")], "dead")  # refused
        assert await shard.commit(H, _meta(H, 4), [Ref("b")], "b")

    asyncio.run(scenario())


def test_commit_many_and_an_evicted_ref_stays_held_for_the_grace_period() -> None:
    a, b, c = "a" * 64, "b" * 64, "c" * 64

    async def scenario() -> None:
        shard = CacheIndexShard(8, evict_grace_s=0.3, start_grace_s=0.0)  # no predecessor here
        answers = await shard.lookup_or_reserve("r", [a, b])
        assert {k for k, _ in answers.values()} == {CacheReply.COMPUTE}
        assert await shard.commit_many(
            [(a, _meta(a, 4), [Ref("ra")], "r"), (b, _meta(b, 4), [Ref("rb")], "r")]
        ) == [
            True,
            True,
        ]
        assert (await shard.lookup_or_reserve("s", [c]))[c][0] == CacheReply.COMPUTE
        assert await shard.commit(c, _meta(c, 4), [Ref("rc")], "s")  # evicts a, the least recently used
        assert set(shard.books.entries) == {b, c}
        expected = {a: "ra", b: "rb", c: "rc"}
        assert sorted(await shard.holding(expected)) == [a, b, c]  # a: evicted, within the grace
        assert await shard.holding({a: "other"}) == []
        await asyncio.sleep(0.35)
        assert sorted(await shard.holding(expected)) == [b, c]
        stats = await shard.stats()
        assert stats["reserved"] == 0 and stats["evictions"] == 1 and stats["used"] == 8

    asyncio.run(scenario())
