"""The shared encoder cache on Ray: single-flight compute, cross-process visibility, eviction at commit,
leases, invalidation, shard sizing and shard recovery."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import numpy as np
import pytest
import ray

from encoder_service.cache.cache_client import EncoderCacheClient, create_cache_index
from encoder_service.cache.cache_index import ref_id
from encoder_service.cache.encoder_cache import CacheReply
from encoder_service.preprocess.errors import EncoderCacheBusy
from encoder_service.preprocess.hashing import compute_mm_hash
from encoder_service.types import EmbeddingMeta
from tests.integration.local_app import own_ray


@pytest.fixture(scope="module")
def ray_session():
    with own_ray(log_to_driver=False):
        yield


def _hash(i: int) -> str:
    return compute_mm_hash("m", "image", data=str(i).encode())


def _meta(h: str, n: int) -> EmbeddingMeta:
    return EmbeddingMeta(h, "image", n, 4, "float32", (1, 2, 2))


def _ref_of(answer: tuple[str, tuple[EmbeddingMeta, Any] | None]) -> Any:
    assert answer[1] is not None
    return answer[1][1]


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
        first = await client.lookup_or_reserve("r0", [h])
        assert first[h][0] == CacheReply.COMPUTE
        again = await client.lookup_or_reserve("r1", [h])
        assert again[h][0] == CacheReply.WAIT  # r0 computes it
        waiters = [asyncio.ensure_future(client.get_or_reserve(f"r{i}", h)) for i in range(1, 12)]
        await asyncio.sleep(0.3)
        assert not any(w.done() for w in waiters)  # they wait for the commit, they don't compute
        ref = ray.put(np.full((4, 4), 2.0, dtype=np.float32))
        assert await client.commit(h, _meta(h, 4), ref, "r0")
        hits = await asyncio.gather(*waiters)
        assert all(
            kind == CacheReply.HIT and payload is not None and payload[0].num_embeds == 4
            for kind, payload in hits
        )
        assert float(np.asarray(ray.get(_ref_of(hits[0]))).sum()) == 32.0
        return await client.stats()

    stats = asyncio.run(scenario())
    assert stats["reserved"] == 0 and stats["entries"] == 1 and stats["used"] == 4
    assert ray.get(_lookup_elsewhere.remote(client, h)) == (4, 32.0)
    assert ray.get(_lookup_elsewhere.remote(client, _hash(2))) is None


def test_failed_compute_hands_over_and_commit_evicts_when_needed(ray_session):
    client = create_cache_index(1, 10, name_prefix=f"t-{uuid.uuid4().hex[:6]}", wait_timeout_s=1.0)
    h, other = _hash(10), _hash(11)

    async def scenario():
        assert (await client.lookup_or_reserve("a", [h]))[h][0] == CacheReply.COMPUTE
        waiter = asyncio.ensure_future(client.get_or_reserve("b", h))
        await asyncio.sleep(0.1)
        await client.release("a")  # "a" failed before committing: "b" takes over the compute
        assert (await waiter)[0] == CacheReply.COMPUTE
        assert await client.commit(h, _meta(h, 6), ray.put(np.zeros(3)), "b")
        assert (await client.lookup_or_reserve("c", [other]))[other][0] == CacheReply.COMPUTE
        assert await client.commit(other, _meta(other, 5), ray.put(np.zeros(3)), "c")  # evicts h
        assert await client.lookup_many([h]) == {}
        # a reservation whose holder never commits (hung) makes its waiters give up, clearly
        lone = _hash(12)
        assert (await client.lookup_or_reserve("d", [lone]))[lone][0] == CacheReply.COMPUTE
        await client.renew("d", [lone])
        with pytest.raises(EncoderCacheBusy, match="did not commit"):
            await client.get_or_reserve("e", lone)
        await client.release("d")
        return await client.stats()

    stats = asyncio.run(scenario())
    assert stats["evictions"] == 1 and stats["entries"] == 1 and stats["reserved"] == 0


def test_invalidate_turns_a_hit_into_compute_and_returns_capacity(ray_session):
    client = create_cache_index(2, 14, name_prefix=f"t-{uuid.uuid4().hex[:6]}", wait_timeout_s=5.0)
    h, other = _hash(20), _hash(21)  # two shards of capacity 7 each, or one of 14: h and other fit apart

    async def scenario():
        assert (await client.lookup_or_reserve("a", [h]))[h][0] == CacheReply.COMPUTE
        lost = ray.put(np.ones((7, 4), dtype=np.float32))
        await client.commit(h, _meta(h, 7), lost, "a")
        hit = (await client.lookup_or_reserve("b", [h]))[h]
        assert hit[0] == CacheReply.HIT and ref_id(_ref_of(hit)) == ref_id(lost)
        stale = ray.put(np.zeros(1))
        assert await client.invalidate([h], {h: ref_id(stale)}) == []  # it holds another ref: kept
        assert (await client.stats())["entries"] == 1
        assert await client.invalidate([h], {h: ref_id(lost)}) == [h]
        stats = await client.stats()
        assert stats["invalidations"] == 1 and stats["entries"] == 0 and stats["used"] == 0
        assert await client.lookup_many([h]) == {}
        # a miss now: compute again
        assert (await client.lookup_or_reserve("c", [h]))[h][0] == CacheReply.COMPUTE
        await client.commit(h, _meta(h, 7), ray.put(np.full((7, 4), 3.0, dtype=np.float32)), "c")
        assert await client.invalidate([h, other]) == [h]  # unconditional; other was never there
        return await client.stats()

    stats = asyncio.run(scenario())
    assert stats["entries"] == 0 and stats["used"] == 0 and stats["reserved"] == 0
    assert stats["invalidations"] == 2


def test_invalidate_before_the_commit_dooms_that_ref(ray_session):
    """The owner shuts down between ``encode`` returning and its commit: the commit of the doomed
    ref drops the entry, and a waiting request takes over the compute."""
    client = create_cache_index(1, 10, name_prefix=f"t-{uuid.uuid4().hex[:6]}", wait_timeout_s=5.0)
    h = _hash(40)

    async def scenario():
        assert (await client.lookup_or_reserve("a", [h]))[h][0] == CacheReply.COMPUTE
        doomed = ray.put(np.zeros(4))
        assert await client.invalidate([h], {h: ref_id(doomed)}) == []  # only reserved so far
        waiter = asyncio.ensure_future(client.get_or_reserve("b", h))
        await asyncio.sleep(0.2)
        assert not await client.commit(h, _meta(h, 4), doomed, "a")
        assert (await asyncio.wait_for(waiter, 2.0))[0] == CacheReply.COMPUTE
        assert await client.lookup_many([h]) == {}
        fresh = ray.put(np.ones(4))
        assert await client.commit(h, _meta(h, 4), fresh, "b")
        hit = await client.get_or_reserve("c", h)
        assert hit[0] == CacheReply.HIT and ref_id(_ref_of(hit)) == ref_id(fresh)
        return await client.stats()

    stats = asyncio.run(scenario())
    assert stats["entries"] == 1 and stats["reserved"] == 0 and stats["used"] == 4


def test_each_shard_holds_the_largest_admitted_item(ray_session):
    """Capacity 100 over 4 shards would be 25 each; the largest admitted item (60) must still fit
    whichever shard its hash lands on."""
    client = create_cache_index(4, 100, name_prefix=f"t-{uuid.uuid4().hex[:6]}", largest_item=60)
    assert client.shard_capacity == 60
    hashes = [_hash(100 + i) for i in range(8)]  # spread over the shards

    async def scenario():
        answers = await client.lookup_or_reserve("r", hashes)
        assert {kind for kind, _ in answers.values()} == {CacheReply.COMPUTE}
        done = await client.commit_many([(_meta(h, 60), ray.put(np.zeros(1)), "r") for h in hashes])
        return done, await client.stats()

    done, stats = asyncio.run(scenario())
    assert all(done) and stats["capacity"] == 240 and stats["reserved"] == 0
    assert {s["entries"] for s in stats["shards"]} == {1}  # each shard keeps its newest one


def test_a_dead_shard_comes_back_empty_whether_ray_restarts_it_or_not(ray_session):
    """Killed as a crash (Ray restarts it) and killed for good (the client re-creates it by name):
    either way its entries are misses, nothing of the old incarnation is reserved, and the call that
    found it dead is retried once on the new one."""
    client = create_cache_index(
        1, 100, name_prefix=f"t-{uuid.uuid4().hex[:6]}", detached=True, namespace="mmserve-test"
    )
    h, g = _hash(200), _hash(201)

    async def fill(rid: str, key: str) -> None:
        assert (await client.lookup_or_reserve(rid, [key]))[key][0] == CacheReply.COMPUTE
        assert await client.commit(key, _meta(key, 4), ray.put(np.zeros(4)), rid)

    async def until_empty() -> None:  # ray.kill returns before the shard is dead
        for _ in range(300):
            if (await client.stats())["entries"] == 0:
                return
            await asyncio.sleep(0.1)
        raise AssertionError("the shard did not come back empty")

    async def scenario():
        await fill("a", h)
        # its holder "dies" too
        assert (await client.lookup_or_reserve("held", [g]))[g][0] == CacheReply.COMPUTE
        ray.kill(client.shards[0], no_restart=False)  # a crash: Ray restarts it
        await until_empty()
        first = await client.lookup_or_reserve("b", [h, g])
        assert {k for k, _ in first.values()} == {CacheReply.COMPUTE}  # both misses on the new incarnation
        after_restart = await client.stats()
        ray.kill(client.shards[0])  # gone for good: the client re-creates it by name
        await until_empty()
        again = await client.lookup_or_reserve("c", [h])
        return after_restart, again, await client.stats()

    try:
        after_restart, again, stats = asyncio.run(scenario())
    finally:
        ray.kill(client.shards[0])
    assert after_restart["entries"] == 2 and after_restart["reserved"] == 2  # b's own reservations
    assert again[h][0] == CacheReply.COMPUTE
    assert again[h][0] == CacheReply.COMPUTE and stats["entries"] == 1 and stats["capacity"] == 100


def test_encoder_replica_shutdown_invalidates_only_what_it_still_owns(ray_session, tiny_vl_dir):
    """``__del__`` as Serve calls it on graceful shutdown: returns a coroutine, awaited on the loop."""
    from encoder_service.preprocess.media import MediaLimits
    from encoder_service.preprocess.processing import Preprocessor
    from encoder_service.serve.deployment import EncodeBatch, EncoderServer
    from encoder_service.types import MediaRef
    from tests.media import make_image_bytes

    client = create_cache_index(2, 10_000, name_prefix=f"t-{uuid.uuid4().hex[:6]}")
    pre = Preprocessor(tiny_vl_dir, MediaLimits(), {"image": 3}, 64 * 1024 * 1024)
    content = [
        {"type": "image", "media": MediaRef("image", data=make_image_bytes(56, 56, seed=s))} for s in (1, 2)
    ]
    items = pre.preprocess_sync([{"role": "user", "content": content}]).items
    server = EncoderServer(str(tiny_vl_dir), cache=client)
    kept, moved = items[0].mm_hash, items[1].mm_hash
    elsewhere = _hash(50)

    async def scenario():
        for it in items:
            assert (await client.get_or_reserve("r", it.mm_hash))[0] == CacheReply.COMPUTE
            assert it.data is not None
            (out,) = await server.encode(EncodeBatch("r", [it.data]))
            assert out.meta.mm_hash == it.mm_hash  # the server committed it itself
        await client.get_or_reserve("r", elsewhere)  # another replica's entry
        await client.commit(elsewhere, _meta(elsewhere, 3), ray.put(np.zeros(3)))
        # `moved` was lost once and re-encoded by another replica: its entry holds another ref now
        (_, ref) = (await client.lookup_many([moved]))[moved]
        assert await client.invalidate([moved], {moved: ref_id(ref)}) == [moved]
        assert (await client.get_or_reserve("s", moved))[0] == CacheReply.COMPUTE
        await client.commit(moved, EmbeddingMeta(moved, "image", items[1].length, 4, "float32"), ray.put(0))
        shutdown = server.__del__()
        assert shutdown is not None
        assert await shutdown == 1
        later = server.__del__()  # nothing owned any more: a later call drops nothing
        assert later is None or await later == 0
        return await client.lookup_many([kept, moved, elsewhere]), await client.stats()

    found, stats = asyncio.run(scenario())
    assert set(found) == {moved, elsewhere} and stats["invalidations"] == 2
    assert server.__del__() is None  # outside an event loop (GC): does nothing


@ray.remote(num_cpus=0.1)
class _ReplicaInAPlacementGroup:
    """Like a TP>1 encoder replica: runs in a placement group that captures its children, with no
    CPU to spare in its bundle."""

    def open_index(self, prefix: str) -> dict[str, Any]:
        client = create_cache_index(2, 64, prefix, detached=True, namespace="mmserve-test")
        return asyncio.run(asyncio.wait_for(client.stats(), 30))


def test_shards_created_inside_a_placement_group_live_outside_it(ray_session) -> None:  # type: ignore[no-untyped-def]
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group([{"CPU": 0.1}])
    ray.get(pg.ready(), timeout=30)
    replica = _ReplicaInAPlacementGroup.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0, placement_group_capture_child_tasks=True)
    ).remote()
    prefix = f"pg-test-{uuid.uuid4().hex[:8]}"
    try:
        # Inside the group the shards could never be scheduled (the bundle's CPU is the replica's).
        stats = ray.get(replica.open_index.remote(prefix), timeout=60)
        assert stats["capacity"] == 64 and len(stats["shards"]) == 2
        ray.kill(replica)
        remove_placement_group(pg)  # the shards must outlive the replica and its group
        survivor = create_cache_index(2, 64, prefix, detached=True, namespace="mmserve-test")
        assert asyncio.run(asyncio.wait_for(survivor.stats(), 30))["capacity"] == 64
    finally:
        for i in range(2):
            ray.kill(ray.get_actor(f"{prefix}-{i}", namespace="mmserve-test"))


def test_a_commit_that_fails_still_answers_the_step_and_the_loop_goes_on(ray_session, tiny_vl_dir):
    """Commits are off the callers' path: an index that refuses every commit costs the entry, not the
    answer, and the next step runs."""
    from encoder_service.encode.runner import EncoderRunner
    from encoder_service.serve.deployment import EncodeBatch, EncoderServer
    from tests.unit.encoder_service.encode.models.inputs import image_input

    class RefusingIndex:
        def __init__(self) -> None:
            self.commits = 0

        async def commit_many(self, commits: list[Any]) -> list[bool]:
            self.commits += 1
            raise RuntimeError("index down")

        async def holding(self, ref_ids: dict[str, str]) -> list[str]:
            return list(ref_ids)

    index = RefusingIndex()
    server = EncoderServer(str(tiny_vl_dir), cache=index)
    items = [image_input(tiny_vl_dir, 56, 56, seed=1), image_input(tiny_vl_dir, 84, 56, seed=2)]
    expected = EncoderRunner(tiny_vl_dir, device="cpu").encode(items)

    async def scenario() -> list[Any]:
        outs = [(await server.encode(EncodeBatch(f"r{i}", [it])))[0] for i, it in enumerate(items)]
        assert await server.drain(timeout_s=10)  # waits for the commits in flight too
        return outs

    outs = asyncio.run(scenario())
    assert index.commits == 2  # each step tried to commit ...
    for out, item, ref in zip(outs, items, expected, strict=True):  # ... and each caller got its answer
        assert out.meta.mm_hash == item.mm_hash
        np.testing.assert_allclose(np.asarray(ray.get(out.ref[0])), ref.numpy(), rtol=1e-5, atol=1e-5)


@ray.remote(num_cpus=0.1)
def _read_elsewhere(refs: list[Any]) -> list[Any]:
    from llm_service.embeddings import from_stored

    out = []
    for r in refs:
        t = from_stored(ray.get(r))
        t.add_(0)  # writable: copied out of the store's read-only buffer
        out.append((str(t.dtype), tuple(t.shape), t.float().sum().item()))
    return out


def test_embeddings_cross_the_object_store_as_numpy_and_come_back_as_the_same_tensor(ray_session):
    """What an encoder replica puts (``stored_form``) is a numpy array or, for bfloat16, its bits
    beside its name: read back in another process it is the tensor that was put, dtype and all."""
    import torch

    from encoder_service.serve.deployment import stored_form

    torch.manual_seed(0)
    tensors = [torch.randn(64, 128), torch.randn(5, 8).to(torch.bfloat16), torch.randn(3, 4).half()]
    assert isinstance(stored_form(tensors[0]), np.ndarray)
    refs = [ray.put(stored_form(t)) for t in tensors]
    got = ray.get(_read_elsewhere.remote(refs), timeout=60)
    want = [(str(t.dtype), tuple(t.shape), t.float().sum().item()) for t in tensors]
    assert got == want
