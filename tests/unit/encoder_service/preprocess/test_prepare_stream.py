"""RequestPreparer.prepare_stream (overlap prefill), without Ray: the real Preprocessor on the tiny
Qwen2-VL, the real cache client and shard in-process, and an encoder whose per-item futures the test
finishes in the order it likes (committing to the index as the encoder does).

It must hand on the same prompt and items as ``prepare``, the ones still encoding first without a
ref and then each as its encode ends (in the order they end), and leave nothing reserved whether it
ends, fails in an encode, or is left early (the queued encodes then cancelled)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest

from encoder_service.cache.cache_client import EncoderCacheClient
from encoder_service.cache.cache_index import CacheIndexShard
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.prepare import RequestPreparer
from encoder_service.preprocess.prepared import PreparedRequest
from encoder_service.preprocess.processing import Preprocessor
from encoder_service.types import EmbeddingMeta, EncodeBatch, EncodedItem, MediaRef
from tests.fakes import Remote
from tests.media import make_image_bytes
from tests.unit.router.journey.hit_path_world import FakeRef


class Encoder:
    """Per-item futures (``EncoderServer.submit``), finished by the test. Every queued item is a
    part of one step's object (``EmbeddingMeta.part``: its place in the queue), as the encoder puts a
    step's items."""

    def __init__(self, cache: EncoderCacheClient) -> None:
        self.cache = cache
        self.queued: dict[str, tuple[asyncio.Future[EncodedItem], Any, str]] = {}

    def submit(self, batch: EncodeBatch) -> list[asyncio.Future[EncodedItem]]:
        futures = []
        for inp in batch.inputs:
            fut: asyncio.Future[EncodedItem] = asyncio.get_running_loop().create_future()
            self.queued[inp.mm_hash] = (fut, inp, batch.request_id)
            futures.append(fut)
        return futures

    async def encode(self, batch: EncodeBatch) -> list[EncodedItem]:
        futures = self.submit(batch)
        for inp in batch.inputs:
            await self.finish(inp.mm_hash)
        return [f.result() for f in futures]

    async def finish(self, mm_hash: str) -> EncodedItem:
        fut, inp, request_id = self.queued[mm_hash]
        part = list(self.queued).index(mm_hash)
        meta = EmbeddingMeta(inp.mm_hash, inp.modality, inp.num_embeds, 8, "float32", inp.grid_thw, part=part)
        out = EncodedItem(meta, [FakeRef()])
        await self.cache.commit_many([(meta, out.ref[0], request_id)])
        fut.set_result(out)
        return out


def _messages(*seeds: int) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [
        {
            "type": "image",
            "media": MediaRef(
                "image",
                url="data:image/png;base64," + base64.b64encode(make_image_bytes(64, 48, seed=s)).decode(),
            ),
        }
        for s in seeds
    ]
    return [{"role": "user", "content": [*content, {"type": "text", "text": "compare them"}]}]


@pytest.fixture
def parts(tiny_vl_dir: Any) -> tuple[RequestPreparer, Encoder, CacheIndexShard]:
    shard = CacheIndexShard(10_000, wait_timeout_s=1.0)
    cache = EncoderCacheClient([Remote(shard)])
    encoder = Encoder(cache)
    pre = Preprocessor(str(tiny_vl_dir), MediaLimits(), {"image": 4}, 0)
    pre.aliases = cache  # type: ignore[assignment]
    preparer = RequestPreparer(pre, cache, encoder.encode, encode_each=encoder.submit)
    return preparer, encoder, shard


async def _reserved(shard: CacheIndexShard) -> int:
    return int((await shard.stats())["reserved"])


async def _tick() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_items_follow_the_prompt_in_the_order_their_encodes_end(parts: Any) -> None:
    preparer, encoder, shard = parts

    async def scenario() -> None:
        frames = preparer.prepare_stream("r", _messages(1, 2, 3))
        first = await anext(frames)
        assert isinstance(first, PreparedRequest) and len(first.items) == 3
        assert all(not it.ref for it in first.items) and first.num_encoded == 3
        hashes = [it.mm_hash for it in first.items]
        assert list(encoder.queued) == hashes  # queued in prompt order
        got = {}
        for h in (hashes[2], hashes[0], hashes[1]):
            out = await encoder.finish(h)
            (item,) = await anext(frames)
            assert item.mm_hash == h and item.ref[0] is out.ref[0]
            assert item.part == out.meta.part == hashes.index(h)  # its place in the step's object
            got[h] = item
        with pytest.raises(StopAsyncIteration):
            await anext(frames)
        # the same prompt and items as ``prepare`` gives (the cache holds them all now)
        whole = await preparer.prepare("again", _messages(1, 2, 3))
        assert whole.prompt_token_ids == first.prompt_token_ids
        assert [(i.offset, i.length, i.grid_thw) for i in whole.items] == [
            (i.offset, i.length, i.grid_thw) for i in first.items
        ]
        assert [i.ref[0].hex() for i in whole.items] == [got[h].ref[0].hex() for h in hashes]
        assert [i.part for i in whole.items] == [0, 1, 2]  # hits carry their part from the index
        assert await _reserved(shard) == 0

    asyncio.run(scenario())


def test_a_hit_comes_with_its_ref_and_only_the_miss_follows(parts: Any) -> None:
    preparer, encoder, shard = parts

    async def scenario() -> None:
        await preparer.prepare("warm", _messages(4))
        frames = preparer.prepare_stream("r", _messages(4, 5))
        first = await anext(frames)
        assert [bool(it.ref) for it in first.items] == [True, False] and first.num_encoded == 1
        await encoder.finish(first.items[1].mm_hash)
        (item,) = await anext(frames)
        assert item.offset == first.items[1].offset
        assert [x async for x in frames] == []
        assert await _reserved(shard) == 0

    asyncio.run(scenario())


def test_a_failed_encode_ends_the_stream_with_its_error_and_releases_everything(parts: Any) -> None:
    preparer, encoder, shard = parts

    async def scenario() -> None:
        frames = preparer.prepare_stream("r", _messages(6, 7))
        first = await anext(frames)
        a, b = (it.mm_hash for it in first.items)
        await encoder.finish(a)
        await anext(frames)
        encoder.queued[b][0].set_exception(RuntimeError("tower blew up"))
        with pytest.raises(RuntimeError, match="tower blew up"):
            await anext(frames)
        assert await _reserved(shard) == 0

    asyncio.run(scenario())


def test_leaving_early_cancels_the_queued_encodes_and_releases_their_reservations(parts: Any) -> None:
    preparer, encoder, shard = parts

    async def scenario() -> None:
        frames = preparer.prepare_stream("r", _messages(8, 9))
        await anext(frames)
        assert await _reserved(shard) == 2
        await frames.aclose()
        await _tick()
        assert all(fut.cancelled() for fut, _, _ in encoder.queued.values())
        assert await _reserved(shard) == 0

    asyncio.run(scenario())
