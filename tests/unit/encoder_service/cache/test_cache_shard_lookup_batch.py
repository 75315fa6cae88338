"""A shard's batched lookup answers each request as its own lookup_or_reserve would, in order."""

from __future__ import annotations

import asyncio

from encoder_service.cache.cache_index import CacheIndexShard
from encoder_service.cache.encoder_cache import CacheReply

A, B = "aa" * 32, "bb" * 32


def test_batched_lookups_answer_in_order_and_are_counted() -> None:
    async def scenario() -> None:
        shard = CacheIndexShard(100)
        await shard.release("gone")  # a released request is refused, in a batch too
        answers = await shard.lookup_or_reserve_batch([("r1", [A]), ("r2", [A, B]), ("gone", [B])])
        assert answers[0] == {A: (CacheReply.COMPUTE, None)}  # r1 reserved A first ...
        # ... so r2 waits for it
        assert answers[1] == {A: (CacheReply.WAIT, None), B: (CacheReply.COMPUTE, None)}
        assert answers[2] == {B: (CacheReply.RELEASED, None)}
        stats = await shard.stats()
        assert (stats["lookup_calls"], stats["lookup_requests"]) == (1, 3)

    asyncio.run(scenario())
