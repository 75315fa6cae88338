"""Orchestrator recovery from lost embeddings, without Ray: the real cache client and shard run
in-process behind a ``.remote`` shim; the LLM fake runs the real ``resolve_embeddings`` and raises
what Ray would deliver (a pickled ``EmbeddingsLost`` inside a ``RayTaskError``).

Every scenario checks the books at the end: no pin left, release called exactly once per request.
"""

from __future__ import annotations

import asyncio
import pickle
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import OwnerDiedError, RayTaskError

from encoder_service.cache_index import CacheIndexShard, EncoderCacheClient
from encoder_service.deployment import EncodeBatch, EncodedItem
from encoder_service.hashing import compute_mm_hash
from encoder_service.types import (
    EmbeddingMeta,
    EncoderInput,
    MediaRef,
    MultiModalItem,
    PlaceholderRange,
    PreprocessedRequest,
)
from llm_service.deployment import EmbeddingsLost, LLMRequestSpec, resolve_embeddings
from llm_service.outputs import RequestOutput
from llm_service.sampling_params import SamplingParams
from router.errors import APIError
from router.messages import NormalizedChat
from router.orchestrator import ModelHandles, Orchestrator

N = 4  # embeddings per image
H1, H2 = (compute_mm_hash("m", "image", data=bytes([i])) for i in (1, 2))


class _Remote:
    """``handle.method.remote(...)`` -> the method's coroutine, as awaiting a Ray ref would give."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> Any:
        return SimpleNamespace(remote=getattr(self._obj, name))


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
    def __init__(self, cache: EncoderCacheClient) -> None:
        self.cache = cache

    async def preprocess(self, messages: list[dict[str, Any]], use_cache: bool = True) -> PreprocessedRequest:
        hashes = [p["hash"] for p in messages[0]["content"]]
        found = await self.cache.lookup_meta(hashes) if use_cache else {}
        items = [
            MultiModalItem(
                index=i,
                mm_hash=h,
                modality="image",
                placeholder=PlaceholderRange(1 + i * N, N),
                grid_thw=(1, 4, 4),
                metadata={},
                encoder_input=None if h in found else EncoderInput(h, "image", N, (1, 4, 4)),
            )
            for i, h in enumerate(hashes)
        ]
        return PreprocessedRequest([9] * (1 + N * len(hashes)) + [5], items)


class FakeEncoder:
    def __init__(self, world: World) -> None:
        self.w = world

    async def encode(self, batch: EncodeBatch) -> list[EncodedItem]:
        out = []
        for inp in batch.inputs:
            self.w.encoded.append(inp.mm_hash)
            meta = EmbeddingMeta(inp.mm_hash, "image", inp.num_embeds, 8, "float32", inp.grid_thw)
            out.append(EncodedItem(meta, [FakeRef(self.w.owner)]))
        if self.w.die_after_encode:
            self.w.dead.add(self.w.owner)
        return out


class FakeStream:
    def __init__(self, gen: AsyncIterator[RequestOutput]) -> None:
        self.gen = gen
        self.cancelled = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> RequestOutput:
        return await self.gen.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


class FakeLLM:
    def __init__(self, world: World) -> None:
        self.w = world
        self.streams: list[FakeStream] = []

    def options(self, **_: Any) -> SimpleNamespace:
        return SimpleNamespace(generate=SimpleNamespace(remote=self._start))

    def _start(self, spec: LLMRequestSpec) -> FakeStream:
        self.streams.append(FakeStream(self._generate(spec)))
        return self.streams[-1]

    async def _generate(self, spec: LLMRequestSpec) -> AsyncIterator[RequestOutput]:
        async def fetch(ref: FakeRef) -> str:
            if ref.owner in self.w.dead:
                raise OwnerDiedError(ref.hex(), None, "")
            return ref.owner

        try:
            await resolve_embeddings(spec.mm_items, fetch)
        except EmbeddingsLost as e:  # what the router's handle raises: pickled, wrapped
            wrapped = RayTaskError("generate", "Traceback", pickle.loads(pickle.dumps(e)))
            raise wrapped.as_instanceof_cause() from None
        self.w.admitted.append(spec)
        yield RequestOutput(spec.request_id, [7], None, True, "length", len(spec.prompt_token_ids), 0)


def _build(world: World) -> tuple[Orchestrator, EncoderCacheClient]:
    cache = EncoderCacheClient([_Remote(CacheIndexShard(100, wait_timeout_s=1.0))])
    handles = ModelHandles(_Remote(FakePreprocess(cache)), _Remote(FakeEncoder(world)), FakeLLM(world), cache)
    return Orchestrator(handles, tokenizer=None, block_size=4), cache


def _chat(*hashes: str) -> NormalizedChat:
    content = [{"type": "image", "hash": h} for h in hashes]
    return NormalizedChat(
        [{"role": "user", "content": content}], [MediaRef("image", data=b"x")] * len(hashes)
    )


async def _prepare(orch: Orchestrator, rid: str, *hashes: str) -> tuple[Any, list[int]]:
    prompt, refs, release = await orch.prepare(rid, _chat(*hashes))
    calls = [0]

    async def counted() -> None:
        calls[0] += 1
        await release()

    return orch.stream_prepared(rid, prompt, refs, SamplingParams(max_tokens=1), counted), calls


async def _finish(stream: Any) -> list[RequestOutput]:
    return [out async for out in stream]


def test_lost_hit_is_invalidated_reencoded_and_served() -> None:
    world = World()

    async def scenario() -> dict[str, Any]:
        orch, cache = _build(world)
        stream, released = await _prepare(orch, "a", H1)
        assert len(await _finish(stream)) == 1 and released == [1]
        world.dead.add("enc-1")  # the replica that encoded H1 dies; the index still lists H1
        world.owner = "enc-2"
        stream, released = await _prepare(orch, "b", H1)
        assert len(await _finish(stream)) == 1 and released == [1]
        return await cache.stats()

    stats = asyncio.run(scenario())
    assert world.encoded == [H1, H1]  # encoded again, on the live replica
    assert [s.mm_items[0].ref[0].owner for s in world.admitted] == ["enc-1", "enc-2"]
    assert stats["invalidations"] == 1 and stats["entries"] == 1 and stats["used"] == N
    assert stats["pinned"] == 0


def test_a_second_loss_is_a_503_and_no_pin_leaks() -> None:
    world = World(die_after_encode=True)  # every replica dies right after encoding

    async def scenario() -> tuple[APIError, dict[str, Any], list[int], list[FakeStream]]:
        orch, cache = _build(world)
        stream, released = await _prepare(orch, "a", H1, H2)
        with pytest.raises(APIError) as e:
            await _finish(stream)
        return e.value, await cache.stats(), released, orch.h.llm.streams

    err, stats, released, streams = asyncio.run(scenario())
    assert err.status_code == 503 and err.code == "embeddings_lost" and "lost twice" in err.message
    assert err.headers() == {"Retry-After": "1"}
    assert released == [1] and world.admitted == []  # never reached the engine
    assert sorted(world.encoded) == sorted([H1, H2, H1, H2])  # both items lost, both redone once
    assert len(streams) == 2 and all(s.cancelled for s in streams)
    assert stats["pinned"] == 0 and stats["entries"] == 0 and stats["used"] == 0
    assert stats["invalidations"] == 4


def test_other_requests_pinning_the_lost_entry_recover_without_a_second_encode() -> None:
    """B and C both hold the dead H1 ref; B invalidates and re-encodes; C's own invalidation must not
    drop B's fresh entry (it holds another ref now), so C is served from it. H2 is never lost."""
    world = World()

    async def scenario() -> dict[str, Any]:
        orch, cache = _build(world)
        await _finish((await _prepare(orch, "a", H1))[0])
        world.dead.add("enc-1")
        world.owner = "enc-2"
        b, b_released = await _prepare(orch, "b", H1, H2)
        c, c_released = await _prepare(orch, "c", H1)  # pins the same dead entry
        assert (await cache.stats())["pinned"] == 2
        await _finish(b)
        await _finish(c)
        assert b_released == [1] and c_released == [1]
        return await cache.stats()

    stats = asyncio.run(scenario())
    assert world.encoded == [H1, H2, H1]  # C reused B's re-encode
    b_spec, c_spec = world.admitted[1:]
    assert [m.ref[0].owner for m in b_spec.mm_items] == ["enc-2", "enc-2"]
    assert c_spec.mm_items[0].ref[0] == b_spec.mm_items[0].ref[0]
    assert stats["invalidations"] == 1 and stats["entries"] == 2 and stats["pinned"] == 0


def test_other_llm_errors_pass_through_and_release_once() -> None:
    world = World()

    async def scenario() -> tuple[list[int], dict[str, Any]]:
        orch, cache = _build(world)
        stream, released = await _prepare(orch, "a", H1)

        async def broken(spec: LLMRequestSpec) -> AsyncIterator[RequestOutput]:
            raise ValueError("bad sampling params")
            yield  # pragma: no cover

        orch.h.llm._generate = broken
        with pytest.raises(ValueError, match="bad sampling"):
            await _finish(stream)
        return released, await cache.stats()

    released, stats = asyncio.run(scenario())
    assert released == [1] and stats["pinned"] == 0 and stats["invalidations"] == 0


def test_resolve_embeddings_names_every_lost_item_and_prefers_other_errors() -> None:
    from llm_service.deployment import EmbeddingRef

    items = [EmbeddingRef([FakeRef(o)], 0, N, h, "image") for o, h in (("dead", H1), ("ok", H2))]

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
