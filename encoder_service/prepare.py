"""One media request's way to its embeddings, taken in the preprocessor pool, next to the cache:

    preprocess ──lookup──▶ pin_committed (hits pinned: one call per shard touched)
        │ process the misses only
        ▼
    acquire (one call per shard: hit / reserve / wait)
        ├─ reserved ──▶ encoder pool (one call for all of them; the encoder commits to the index)
        └─ wait ──────▶ get_or_reserve after our own encodes (no request waits while holding a
                        reservation another one waits for, so two requests never deadlock)

The router gets prompt ids and, per item, a pinned ObjectRef: one round trip instead of five. On any
failure (or when the caller leaves) the request's pins and reservations are released here.
No Ray import: the cache client and the encoder call are injected (deployment.py wires them).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from encoder_service.prepared import PreparedItem, PreparedRequest
from encoder_service.types import EmbeddingMeta, EncodeBatch, EncodedItem, MultiModalItem, PreprocessedRequest

logger = logging.getLogger("mmserve.encoder")

HIT, COMPUTE, WAIT = "hit", "compute", "wait"

Found = tuple[EmbeddingMeta, Any]  # metadata, ObjectRef
Encode = Callable[[EncodeBatch], Awaitable[list[EncodedItem]]]


class CacheIndex(Protocol):
    """What preparing needs of the shared encoder cache (encoder_service.cache_index.EncoderCacheClient)."""

    async def pin_committed(self, request_id: str, hashes: list[str]) -> dict[str, Found]: ...

    async def acquire(
        self, request_id: str, wanted: Mapping[str, int]
    ) -> dict[str, tuple[str, Found | None]]: ...

    async def get_or_reserve(
        self, request_id: str, mm_hash: str, num_embeds: int
    ) -> tuple[str, Found | None]: ...

    async def release(self, request_id: str, hashes: list[str] | None = None) -> None: ...


class Preprocess(Protocol):
    async def preprocess(self, messages: list[dict[str, Any]], lookup: Any = None) -> PreprocessedRequest: ...


class RequestPreparer:
    def __init__(self, preprocessor: Preprocess, cache: CacheIndex, encode: Encode) -> None:
        self.preprocessor = preprocessor
        self.cache = cache
        self.encode = encode

    async def prepare(self, request_id: str, messages: list[dict[str, Any]]) -> PreparedRequest:
        """Prompt ids and pinned embeddings for every media item of ``messages``, pins held by
        ``request_id`` (the router releases them once the LLM replica holds the embeddings)."""
        hits: dict[str, Found] = {}

        async def lookup(hashes: list[str]) -> dict[str, EmbeddingMeta]:
            found = await self.cache.pin_committed(request_id, hashes)
            hits.update(found)
            return {h: meta for h, (meta, _) in found.items()}

        touched: list[str] = []
        try:
            pre = await self.preprocessor.preprocess(messages, lookup)
            touched = list(dict.fromkeys(it.mm_hash for it in pre.items))
            refs, num_encoded = await self._embeddings(request_id, pre, hits)
        except BaseException:
            # Shielded: a cancelled caller must still give back what it pinned or reserved.
            await asyncio.shield(self._release(request_id, touched or list(hits)))
            raise
        items = [
            PreparedItem(
                it.mm_hash,
                it.modality,
                it.placeholder.offset,
                it.placeholder.length,
                it.grid_thw,
                [refs[it.mm_hash]],
                second_per_grid_ts=it.second_per_grid_ts,
            )
            for it in pre.items
        ]
        return PreparedRequest(list(pre.prompt_token_ids), items, num_encoded, pre.to_log())

    async def _release(self, request_id: str, hashes: list[str]) -> None:
        try:
            await self.cache.release(request_id, hashes or None)
        except Exception:
            logger.exception("releasing encoder-cache pins of %s failed", request_id)

    async def _embeddings(
        self, request_id: str, pre: PreprocessedRequest, hits: dict[str, Found]
    ) -> tuple[dict[str, Any], int]:
        refs = {h: ref for h, (_, ref) in hits.items()}
        todo: dict[str, MultiModalItem] = {}
        for it in pre.items:
            if it.mm_hash not in refs:
                todo.setdefault(it.mm_hash, it)
        if not todo:
            return refs, 0
        answers = await self.cache.acquire(request_id, {h: it.num_embeds for h, it in todo.items()})
        compute: list[MultiModalItem] = []
        wait: list[MultiModalItem] = []
        for h, (kind, found) in answers.items():
            if kind == HIT and found is not None:
                refs[h] = found[1]
            else:
                (compute if kind == COMPUTE else wait).append(todo[h])
        num_encoded = await self._encode(request_id, compute, refs)
        for retry in await asyncio.gather(*(self._wait(request_id, it, refs) for it in wait)):
            if retry is not None:
                num_encoded += await self._encode(request_id, [retry], refs)
        return refs, num_encoded

    async def _wait(self, request_id: str, it: MultiModalItem, refs: dict[str, Any]) -> MultiModalItem | None:
        """Another request was computing ``it``: its result (pinned), or ``it`` back if we must compute."""
        kind, found = await self.cache.get_or_reserve(request_id, it.mm_hash, it.num_embeds)
        if kind == HIT and found is not None:
            refs[it.mm_hash] = found[1]
            return None
        return it

    async def _encode(self, request_id: str, items: list[MultiModalItem], refs: dict[str, Any]) -> int:
        if not items:
            return 0
        inputs = []
        for it in items:
            if it.encoder_input is None:  # processed items always carry it: a bug, not bad input
                raise RuntimeError(f"{it.modality} {it.index} was not processed but must be encoded")
            inputs.append(it.encoder_input)
        encoded = await self.encode(EncodeBatch(request_id, inputs))
        for out in encoded:
            refs[out.meta.mm_hash] = out.ref[0]
        return len(encoded)
