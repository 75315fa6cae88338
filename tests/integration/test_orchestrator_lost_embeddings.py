"""Orchestrator recovery from lost embeddings, in the world of ``orchestrator_world`` (no cluster:
the real cache client, shard and ``RequestPreparer`` in-process), with the errors Ray delivers: a
fetch from a dead owner raises ``OwnerDiedError``, and ``submit`` a pickled ``EmbeddingsLost`` inside
a ``RayTaskError``.

Every scenario checks the books at the end: no reservation left.
"""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, OwnerDiedError, RayTaskError

from encoder_service.cache.cache_client import EncoderCacheClient
from encoder_service.preprocess.prepare import RequestPreparer
from llm_service.embeddings import EmbeddingsLost, resolve_embeddings
from llm_service.request_spec import LLMRequestSpec, SubmitReply
from mmcore.feature import MediaFeature
from router.journey.orchestrator import Orchestrator
from router.protocol.errors import APIError
from tests.fakes import Remote
from tests.unit.router.journey import orchestrator_world
from tests.unit.router.journey.orchestrator_world import (
    H1,
    H2,
    FakeRef,
    LostErrors,
    N,
    World,
    _chat,
    _finish,
    _prepare,
)

RAY_ERRORS = LostErrors(
    owner_died=lambda ref_hex: OwnerDiedError(ref_hex, None, ""),
    submit_failed=lambda e: RayTaskError("submit", "Traceback", e).as_instanceof_cause(),
)


def _build(
    world: World, cache: EncoderCacheClient | None = None, encoder: Any = None, late: bool = False
) -> tuple[Orchestrator, EncoderCacheClient]:
    return orchestrator_world._build(world, cache, encoder, late, RAY_ERRORS)


def test_lost_hit_is_invalidated_reencoded_and_served() -> None:
    world = World()

    async def scenario() -> dict[str, Any]:
        orch, cache = _build(world)
        stream = await _prepare(orch, "a", H1)
        assert len(await _finish(stream)) == 1
        world.dead.add("enc-1")  # the replica that encoded H1 dies; the index still lists H1
        world.owner = "enc-2"
        stream = await _prepare(orch, "b", H1)
        assert len(await _finish(stream)) == 1
        return await cache.stats()

    stats = asyncio.run(scenario())
    assert world.encoded == [H1, H1]  # encoded again, on the live replica
    assert [s.mm_items[0].ref[0].owner for s in world.admitted] == ["enc-1", "enc-2"]
    assert stats["invalidations"] == 1 and stats["entries"] == 1 and stats["used"] == N
    assert stats["reserved"] == 0


def test_a_loss_found_after_submit_before_any_output_is_reencoded_and_served() -> None:
    """The replica skipped the fetch (prefix-cached span), the blocks were evicted, and the fetch it
    makes then finds the owner dead: the loss comes on the output stream, before any token. The
    router treats it as a loss at submit: invalidated, re-encoded, submitted again."""
    world = World()

    async def scenario() -> dict[str, Any]:
        orch, cache = _build(world, late=True)
        assert len(await _finish(await _prepare(orch, "a", H1))) == 1
        world.dead.add("enc-1")
        world.owner = "enc-2"
        assert len(await _finish(await _prepare(orch, "b", H1))) == 1
        return await cache.stats()

    stats = asyncio.run(scenario())
    assert world.encoded == [H1, H1]
    assert [s.mm_items[0].ref[0].owner for s in world.admitted] == ["enc-1", "enc-1", "enc-2"]
    assert stats["invalidations"] == 1 and stats["reserved"] == 0


def test_a_second_loss_is_a_503_and_no_reservation_leaks() -> None:
    world = World(die_after_encode=True)  # every replica dies right after encoding

    async def scenario() -> tuple[APIError, dict[str, Any], int]:
        orch, cache = _build(world)
        stream = await _prepare(orch, "a", H1, H2)
        with pytest.raises(APIError) as e:
            await _finish(stream)
        return e.value, await cache.stats(), orch.handles.llm.submits  # type: ignore[attr-defined]

    err, stats, submits = asyncio.run(scenario())
    assert err.status_code == 503 and err.code == "embeddings_lost" and "lost twice" in err.message
    assert err.headers() == {"Retry-After": "1"}
    assert world.admitted == []  # never reached the engine
    assert sorted(world.encoded) == sorted([H1, H2, H1, H2])  # both items lost, both redone once
    assert submits == 2
    assert stats["reserved"] == 0 and stats["entries"] == 0 and stats["used"] == 0
    assert stats["invalidations"] == 4


def test_other_requests_holding_the_lost_ref_recover_without_a_second_encode() -> None:
    """B and C both hold the dead H1 ref; B invalidates and re-encodes; C's own invalidation must not
    drop B's fresh entry (it holds another ref now), so C is served from it. H2 is never lost."""
    world = World()

    async def scenario() -> dict[str, Any]:
        orch, cache = _build(world)
        await _finish(await _prepare(orch, "a", H1))
        world.dead.add("enc-1")
        world.owner = "enc-2"
        b = await _prepare(orch, "b", H1, H2)
        c = await _prepare(orch, "c", H1)  # holds the same dead ref
        assert (await cache.stats())["reserved"] == 0  # a prepared request holds nothing in the index
        await _finish(b)
        await _finish(c)
        return await cache.stats()

    stats = asyncio.run(scenario())
    assert world.encoded == [H1, H2, H1]  # C reused B's re-encode
    b_spec, c_spec = world.admitted[1:]
    assert [m.ref[0].owner for m in b_spec.mm_items] == ["enc-2", "enc-2"]
    assert c_spec.mm_items[0].ref[0] == b_spec.mm_items[0].ref[0]
    assert stats["invalidations"] == 1 and stats["entries"] == 2 and stats["reserved"] == 0


def test_other_llm_errors_pass_through_and_leave_nothing_held() -> None:
    world = World()

    async def scenario() -> dict[str, Any]:
        orch, cache = _build(world)
        stream = await _prepare(orch, "a", H1)

        async def broken(spec: LLMRequestSpec) -> SubmitReply:
            raise ValueError("bad sampling params")

        orch.handles.llm.submit = broken  # type: ignore[method-assign]
        assert (await cache.stats())["reserved"] == 0
        with pytest.raises(ValueError, match="bad sampling"):
            await _finish(stream)
        return await cache.stats()

    stats = asyncio.run(scenario())
    assert stats["reserved"] == 0 and stats["invalidations"] == 0


def test_resolve_embeddings_names_every_lost_item_and_prefers_other_errors() -> None:
    items = [MediaFeature(0, "image", h, 0, N, ref=[FakeRef(o)]) for o, h in (("dead", H1), ("ok", H2))]

    async def lost_or_ok(ref: FakeRef) -> str:
        if ref.owner == "dead":
            raise OwnerDiedError(ref.hex(), None, "")
        return ref.owner

    async def lost_or_broken(ref: FakeRef) -> str:
        if ref.owner == "dead":
            raise OwnerDiedError(ref.hex(), None, "")
        raise RuntimeError("object store bug")

    with pytest.raises(EmbeddingsLost) as e:
        asyncio.run(resolve_embeddings(items, lost_or_ok))
    assert e.value.mm_hashes == [H1] and H1[:16] in str(e.value)
    assert pickle.loads(pickle.dumps(e.value)).mm_hashes == [H1]
    with pytest.raises(RuntimeError, match="object store bug"):
        asyncio.run(resolve_embeddings(items, lost_or_broken))


class DyingPreparer:
    """A preparing replica that dies (``ActorDiedError``) after reserving, for its first ``deaths`` calls."""

    def __init__(
        self, preparer: RequestPreparer, deaths: int, error: type[Exception] = ActorDiedError
    ) -> None:
        self.preparer, self.deaths, self.error, self.calls = preparer, deaths, error, []

    async def prepare(self, request_id: str, messages: list[dict[str, Any]]) -> Any:
        self.calls.append(request_id)
        if len(self.calls) <= self.deaths:
            hashes = [p["hash"] for p in messages[0]["content"]]
            await self.preparer.cache.lookup_or_reserve(request_id, hashes)  # reserved, then the replica dies
            raise self.error()
        return await self.preparer.prepare(request_id, messages)


@pytest.mark.parametrize("deaths", [1, 2])
def test_a_prepare_whose_replica_dies_is_prepared_again_and_releases(deaths: int) -> None:
    world = World()

    async def scenario() -> tuple[DyingPreparer, dict[str, Any]]:
        orch, cache = _build(world)
        dying = DyingPreparer(orch.handles.encoder._obj, deaths)  # type: ignore[attr-defined]
        orch.handles.encoder = Remote(dying)  # type: ignore[assignment]
        assert len(await _finish(await _prepare(orch, "a", H1))) == 1
        return dying, await cache.stats()

    dying, stats = asyncio.run(scenario())
    assert dying.calls == ["a", "a#p2", "a#p3"][: deaths + 1]  # a fresh attempt id each time
    assert world.encoded == [H1]  # the dead attempts' reservations were released, not waited out
    assert stats["reserved"] == 0 and stats["entries"] == 1


def test_a_prepare_that_fails_otherwise_or_dies_every_time_is_not_retried_forever() -> None:
    world = World()

    async def scenario(deaths: int, error: type[Exception]) -> tuple[DyingPreparer, dict[str, Any]]:
        orch, cache = _build(world)
        dying = DyingPreparer(orch.handles.encoder._obj, deaths, error)  # type: ignore[attr-defined]
        orch.handles.encoder = Remote(dying)  # type: ignore[assignment]
        with pytest.raises(error):
            await orch.prepare("a", _chat(H1))
        return dying, await cache.stats()

    dying, stats = asyncio.run(scenario(1, ValueError))
    assert dying.calls == ["a"] and stats["reserved"] == 0
    dying, stats = asyncio.run(scenario(10, ActorDiedError))
    assert dying.calls == ["a", "a#p2", "a#p3"] and stats["reserved"] == 0
    assert world.encoded == []
