"""A client that leaves while its request is being prepared must leave no encoder-cache reservation.

The cache shard runs in-process behind a shim that behaves like a Ray actor handle: each call runs
on its own, in submission order, and a caller that stops awaiting it (cancelled) does not stop it.
The other fakes come from the lost-embeddings tests.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from encoder_service.cache.cache_client import EncoderCacheClient
from encoder_service.cache.cache_index import CacheIndexShard
from encoder_service.types import EncodeBatch, EncodedItem
from tests.unit.router.journey.orchestrator_world import (
    H1,
    FakeEncoder,
    World,
    _build,
    _finish,
    _prepare,
)


class _RayActor:
    def __init__(self, obj: Any) -> None:
        self._obj = obj
        self.calls: list[tuple[str, tuple[Any, ...], asyncio.Future[Any]]] = []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._obj, name)

        def remote(*args: Any, **kwargs: Any) -> asyncio.Future[Any]:
            call = asyncio.ensure_future(method(*args, **kwargs))
            self.calls.append((name, args, call))
            return asyncio.shield(call)

        return SimpleNamespace(remote=remote)


class GatedEncoder(FakeEncoder):
    """Encodes when ``gate`` opens (a Serve call: cancelling the caller cancels it)."""

    def __init__(self, world: World, cache: EncoderCacheClient) -> None:
        super().__init__(world, cache)
        self.gate = asyncio.Event()

    async def encode(self, batch: EncodeBatch) -> list[EncodedItem]:
        await self.gate.wait()
        return await super().encode(batch)


async def _until(condition: Any, what: str) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"timed out waiting for {what}")


def test_client_leaving_while_waiting_for_another_requests_encode_leaves_no_reservation() -> None:
    """A encodes H1 (reserved, encoder busy); B wants H1 too and waits in the shard for A's commit.
    B's client leaves (the ingress task is cancelled): B releases its reservations, but its waiting
    get_or_reserve runs on in the shard, as a Ray actor call does."""
    world = World()

    async def scenario() -> dict[str, Any]:
        shard = CacheIndexShard(100, wait_timeout_s=5.0)
        actor = _RayActor(shard)
        cache = EncoderCacheClient([actor])
        encoder = GatedEncoder(world, cache)
        orch, _ = _build(world, cache, encoder)

        a = asyncio.create_task(_prepare(orch, "a", H1))
        await _until(lambda: shard.books.num_reserved == 1, "A's reservation")
        b = asyncio.create_task(_prepare(orch, "b", H1))
        await _until(
            lambda: any(name == "get_or_reserve" and args[0] == "b" for name, args, _ in actor.calls),
            "B to ask the shard for H1",
        )
        b.cancel()  # B's release is submitted after its get_or_reserve, which waits for A's commit
        await asyncio.gather(b, return_exceptions=True)
        encoder.gate.set()
        await _finish(await a)
        await asyncio.gather(*(c for _, _, c in actor.calls), return_exceptions=True)  # all have run
        return await cache.stats()

    stats = asyncio.run(scenario())
    assert world.encoded == [H1]
    assert stats["entries"] == 1 and stats["reserved"] == 0


def test_two_requests_with_crossed_items_never_deadlock_and_encode_each_once() -> None:
    """A wants (H1, H2), B wants (H2, H1), concurrently, the encoder held until both asked: one
    reserves and encodes, the other waits for commits it does not hold a reservation against
    (reservations are taken without waiting, own items encoded before waiting for anyone else's), so
    both finish and each item is encoded once."""
    from tests.unit.router.journey.orchestrator_world import H2

    world = World()

    async def scenario() -> dict[str, Any]:
        shard = CacheIndexShard(100, wait_timeout_s=5.0)
        cache = EncoderCacheClient([_RayActor(shard)])
        encoder = GatedEncoder(world, cache)
        orch, _ = _build(world, cache, encoder)
        a = asyncio.create_task(_prepare(orch, "a", H1, H2))
        b = asyncio.create_task(_prepare(orch, "b", H2, H1))
        await _until(lambda: shard.books.num_reserved >= 2, "both reservations")
        encoder.gate.set()
        streams = await asyncio.wait_for(asyncio.gather(a, b), 5)
        for s in streams:
            assert len(await _finish(s)) == 1
        return await cache.stats()

    stats = asyncio.run(scenario())
    assert sorted(world.encoded) == sorted([H1, H2])
    assert stats["reserved"] == 0 and stats["hits"] + stats["misses"] == 4
