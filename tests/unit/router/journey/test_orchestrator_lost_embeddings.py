"""Orchestrator recovery from lost embeddings, without Ray: the real cache client and shard and the
real ``RequestPreparer`` run in-process behind a ``.remote`` shim; the encoder fake commits its
outputs to the index as the real one does; the LLM fake runs the real ``resolve_embeddings`` in
``submit`` and raises what Ray would deliver (a pickled ``EmbeddingsLost`` inside a ``RayTaskError``).

Every scenario checks the books at the end: no reservation left.
"""

from __future__ import annotations

import asyncio
import pickle
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, OwnerDiedError, RayTaskError

from encoder_service.cache.cache_client import EncoderCacheClient
from encoder_service.cache.cache_index import CacheIndexShard
from encoder_service.preprocess.hashing import compute_mm_hash
from encoder_service.preprocess.prepare import RequestPreparer
from encoder_service.types import (
    EmbeddingMeta,
    EncodeBatch,
    EncodedItem,
    EncoderInput,
    MediaRef,
    PreprocessedRequest,
)
from llm_service.embeddings import EmbeddingsLost, resolve_embeddings
from llm_service.outputs import RequestOutput
from llm_service.request_spec import LLMRequestSpec, SubmitReply
from llm_service.sampling_params import SamplingParams
from mmcore.feature import MediaFeature
from router.journey.model_handles import ModelHandles
from router.journey.orchestrator import Orchestrator
from router.protocol.errors import APIError
from router.protocol.messages import NormalizedChat
from tests.fakes import Remote

N = 4  # embeddings per image
H1, H2 = (compute_mm_hash("m", "image", data=bytes([i])) for i in (1, 2))


@dataclass
class FakeRef:
    owner: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def hex(self) -> str:
        return self.id


@dataclass
class World:
    """Encoder replicas are names; killing one makes every ref it owns lost."""

    owner: str = "enc-1"
    dead: set[str] = field(default_factory=set)
    die_after_encode: bool = False
    encoded: list[str] = field(default_factory=list)
    admitted: list[LLMRequestSpec] = field(default_factory=list)


class FakePreprocess:
    """The Preprocessor's contract: hash, ask ``lookup`` which items are cached, process the rest."""

    async def preprocess(
        self, messages: list[dict[str, Any]], lookup: Any = None, *, hashes: Any = None, process: bool = True
    ) -> PreprocessedRequest:
        hashes = [p["hash"] for p in messages[0]["content"]]
        found = await lookup(hashes) if lookup is not None else {}
        items = [
            MediaFeature(
                i,
                "image",
                h,
                1 + i * N,
                N,
                (1, 4, 4),
                data=None if h in found else EncoderInput(h, "image", N, (1, 4, 4)),
            )
            for i, h in enumerate(hashes)
        ]
        return PreprocessedRequest([9] * (1 + N * len(hashes)) + [5], items)


class FakeEncoder:
    """Encodes (a name stands for the tensor) and commits to the index, as EncoderServer does."""

    def __init__(self, world: World, cache: EncoderCacheClient) -> None:
        self.w = world
        self.cache = cache

    async def encode(self, batch: EncodeBatch) -> list[EncodedItem]:
        out = []
        for inp in batch.inputs:
            self.w.encoded.append(inp.mm_hash)
            meta = EmbeddingMeta(inp.mm_hash, "image", inp.num_embeds, 8, "float32", inp.grid_thw)
            out.append(EncodedItem(meta, [FakeRef(self.w.owner)]))
        for e in out:
            await self.cache.commit(e.meta.mm_hash, e.meta, e.ref[0], batch.request_id)
        if self.w.die_after_encode:
            self.w.dead.add(self.w.owner)
        return out


class FakeLLM:
    """The LLMClient surface: ``submit`` fetches the embeddings (real ``resolve_embeddings``).
    ``late``: it does not (their span is prefix-cached, as LLMServer sees it); the first output
    fetches them instead, as a parked request's replica does, and a loss arrives on the stream."""

    def __init__(self, world: World, late: bool = False) -> None:
        self.w = world
        self.late = late
        self.submits = 0

    async def _fetch_all(self, spec: LLMRequestSpec) -> None:
        async def fetch(ref: FakeRef) -> str:
            if ref.owner in self.w.dead:
                raise OwnerDiedError(ref.hex(), None, "")
            return ref.owner

        await resolve_embeddings(spec.mm_items, fetch)

    async def submit(self, spec: LLMRequestSpec) -> SubmitReply:
        self.submits += 1
        try:
            if not self.late:
                await self._fetch_all(spec)
        except EmbeddingsLost as e:  # what the router's handle raises: pickled, wrapped
            wrapped = RayTaskError("submit", "Traceback", pickle.loads(pickle.dumps(e)))
            raise wrapped.as_instanceof_cause() from None
        self.w.admitted.append(spec)
        return SubmitReply("llm-0", "ch-0")

    async def outputs(self, request_id: str, reply: SubmitReply) -> AsyncIterator[RequestOutput]:
        spec = [s for s in self.w.admitted if s.request_id == request_id][-1]
        if self.late:
            try:
                await self._fetch_all(spec)
            except EmbeddingsLost as e:  # what a channel batch's error is: pickled
                raise pickle.loads(pickle.dumps(e)) from None
        yield RequestOutput(request_id, [7], None, True, "length", len(spec.prompt_token_ids), 0)


def _build(
    world: World, cache: EncoderCacheClient | None = None, encoder: Any = None, late: bool = False
) -> tuple[Orchestrator, EncoderCacheClient]:
    cache = cache or EncoderCacheClient([Remote(CacheIndexShard(100, wait_timeout_s=1.0))])
    encoder = encoder or FakeEncoder(world, cache)
    preparer = RequestPreparer(FakePreprocess(), cache, encoder.encode)
    handles = ModelHandles(Remote(preparer), FakeLLM(world, late), cache)  # type: ignore[arg-type]
    return Orchestrator(handles, tokenizer=None, block_size=4), cache


def _chat(*hashes: str) -> NormalizedChat:
    content = [{"type": "image", "hash": h} for h in hashes]
    return NormalizedChat(
        [{"role": "user", "content": content}], [MediaRef("image", data=b"x")] * len(hashes)
    )


async def _prepare(orch: Orchestrator, rid: str, *hashes: str) -> Any:
    prepared = await orch.prepare(rid, _chat(*hashes))
    return orch.stream(rid, prepared, SamplingParams(max_tokens=1))


async def _finish(stream: Any) -> list[RequestOutput]:
    outs = [out async for out in stream]
    return outs


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
