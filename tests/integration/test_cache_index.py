"""The shared encoder cache on Ray: single-flight compute, cross-process visibility, release unpins."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest
import ray

from encoder_service.cache_index import COMPUTE, HIT, EncoderCacheClient, create_cache_index
from encoder_service.errors import EncoderCacheBusy, EncoderCacheFull
from encoder_service.hashing import compute_mm_hash
from encoder_service.types import EmbeddingMeta


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _hash(i: int) -> str:
    return compute_mm_hash("m", "image", data=str(i).encode())


def _meta(h: str, n: int) -> EmbeddingMeta:
    return EmbeddingMeta(h, "image", n, 4, "float32", (1, 2, 2))


@ray.remote(num_cpus=0.1)
def _lookup_elsewhere(client: EncoderCacheClient, h: str) -> tuple[int, float] | None:
    found = asyncio.run(client.lookup_many([h]))
    if h not in found:
        return None
    meta, ref = found[h]
    return meta.num_embeds, float(ray.get(ref).sum())


def test_single_flight_and_cross_process_lookup(ray_session):
    client = create_cache_index(2, 1000, name_prefix=f"t-{uuid.uuid4().hex[:6]}")
    h = _hash(1)

    async def scenario():
        tasks = [asyncio.ensure_future(client.get_or_reserve(f"r{i}", h, 4)) for i in range(12)]
        done, waiters = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(0.3)
        assert len(done) == 1 and next(iter(done)).result()[0] == COMPUTE
        assert not any(w.done() for w in waiters)  # they wait for the commit, they don't compute
        ref = ray.put(np.full((4, 4), 2.0, dtype=np.float32))
        await client.commit(h, _meta(h, 4), ref)
        done = await asyncio.gather(*waiters)
        assert all(kind == HIT and payload[0].num_embeds == 4 for kind, payload in done)
        assert float(np.asarray(ray.get(done[0][1][1])).sum()) == 32.0
        return await client.stats()

    stats = asyncio.run(scenario())
    assert stats["pinned"] == 1 and stats["entries"] == 1
    assert ray.get(_lookup_elsewhere.remote(client, h)) == (4, 32.0)
    assert ray.get(_lookup_elsewhere.remote(client, _hash(2))) is None

    async def release_all():
        for i in range(12):
            await client.release(f"r{i}")
        return await client.stats()

    after = asyncio.run(release_all())
    assert after["pinned"] == 0 and after["entries"] == 1  # unpinned, kept until space is needed


def test_failed_compute_hands_over_and_eviction_when_needed(ray_session):
    client = create_cache_index(1, 10, name_prefix=f"t-{uuid.uuid4().hex[:6]}", wait_timeout_s=1.0)
    h, other = _hash(10), _hash(11)

    async def scenario():
        assert (await client.get_or_reserve("a", h, 6))[0] == COMPUTE
        waiter = asyncio.ensure_future(client.get_or_reserve("b", h, 6))
        await asyncio.sleep(0.1)
        await client.release("a")  # "a" failed before committing: "b" takes over the compute
        assert (await waiter)[0] == COMPUTE
        await client.commit(h, _meta(h, 6), ray.put(np.zeros(3)))
        # all 6 pinned by "b", 4 free: a 5-embedding item waits, then times out with a clear error
        with pytest.raises(EncoderCacheBusy, match="pinned"):
            await client.get_or_reserve("c", other, 5)
        with pytest.raises(EncoderCacheFull, match="encoder_cache_size=10"):
            await client.get_or_reserve("c", other, 11)
        await client.release("b")
        assert (await client.get_or_reserve("c", other, 5))[0] == COMPUTE  # evicts h now
        assert await client.lookup_many([h]) == {}
        return await client.stats()

    stats = asyncio.run(scenario())
    assert stats["evictions"] == 1 and stats["entries"] == 1
