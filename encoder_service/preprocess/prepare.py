"""One media request's way to its embeddings, taken in the preprocessor pool, next to the cache:

    preprocess ──lookup──▶ lookup_or_reserve (one call per shard touched): per item
        │                    hit (its ref) / compute (reserved for us, leased) / wait (another
        │                    request computes it)
        │ process the non-hits only
        ▼
    compute ──▶ encoder pool (one call for all of them; the encoder commits to the index)
    wait ─────▶ get_or_reserve after our own encodes (no request waits while holding a
                reservation another one waits for, so two requests never deadlock)

The router gets prompt ids and, per item, the ObjectRef of its embeddings: one round trip. Nothing is
pinned: the request holds its refs itself. While it holds reservations it renews their lease; on any
failure (or when the caller leaves) they are released here.
No Ray import: the cache client and the encoder call are injected (``make_preparer.py`` builds one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Protocol

from encoder_service.cache.encoder_cache import COMPUTE, DEFAULT_LEASE_S, HIT, CacheReply
from encoder_service.cache.near_cache import NearCache
from encoder_service.preprocess.errors import EncoderCacheFull
from encoder_service.preprocess.gathering import gather
from encoder_service.preprocess.media_items import Message
from encoder_service.preprocess.prepared import Answer, Found, LookedUp, PreparedRequest
from encoder_service.preprocess.processing import Lookup, NeedsEncoding
from encoder_service.preprocess.stage_timing import CacheLookups, MediaStages
from encoder_service.types import EmbeddingMeta, EncodeBatch, EncodedItem, EncoderInput, PreprocessedRequest
from mmcore.feature import MediaFeature

logger = logging.getLogger("mmserve.encoder")

Encode = Callable[[EncodeBatch], Awaitable[list[EncodedItem]]]
# One future per input (EncoderServer.submit): what lets ``prepare_stream`` hand on each item
# as its own encoder step ends.
EncodeEach = Callable[[EncodeBatch], list["asyncio.Future[EncodedItem]"]]


class CacheIndex(Protocol):
    """What preparing needs of the shared encoder cache (encoder_service.cache.cache_client.EncoderCacheClient)."""

    @property
    def shard_capacity(self) -> int | None: ...

    async def lookup_or_reserve(self, request_id: str, hashes: list[str]) -> dict[str, Answer]: ...

    async def get_or_reserve(self, request_id: str, mm_hash: str) -> Answer: ...

    async def renew(self, request_id: str, hashes: list[str]) -> None: ...

    async def release(self, request_id: str, hashes: list[str] | None = None) -> None: ...


class Preprocess(Protocol):
    async def preprocess(
        self,
        messages: Sequence[Message],
        lookup: Lookup | None = None,
        *,
        hashes: list[str] | None = None,
        process: bool = True,
        deferred: list[asyncio.Task[None]] | None = None,
    ) -> PreprocessedRequest: ...


class RequestPreparer:
    def __init__(
        self,
        preprocessor: Preprocess,
        cache: CacheIndex,
        encode: Encode,
        lease_s: float = DEFAULT_LEASE_S,
        near: NearCache | None = None,
        stages: MediaStages | None = None,
        encode_each: EncodeEach | None = None,
    ) -> None:
        self.preprocessor = preprocessor
        self.encode_each = encode_each  # None: no ``prepare_stream`` (the ingress's hit path)
        self.stages = stages  # cache lookup and wait timings, answers counted (stage_timing.py)
        self.cache = cache
        self.encode = encode
        self.renew_every_s = lease_s / 3
        self.near = near  # the ingress's hit path: entries seen lately, asked before the index

    def _lookup(
        self, request_id: str, hits: dict[str, Found], kinds: dict[str, CacheReply], given: LookedUp | None
    ) -> Callable[[list[str]], Awaitable[dict[str, EmbeddingMeta]]]:
        """The preprocessor's lookup: reserve-or-hit per item, the answers ``given`` first."""

        async def lookup(hashes: list[str]) -> dict[str, EmbeddingMeta]:
            start = time.perf_counter()
            answers = {h: given.found[h] for h in hashes if h in given.found} if given else {}
            num_given = len(answers)
            if self.near is not None:
                for h in hashes:
                    if h not in answers and (near := self.near.get(h)) is not None:
                        answers[h] = (HIT, near)
            todo = [h for h in hashes if h not in answers]
            if todo:
                asked = await self.cache.lookup_or_reserve(request_id, todo)
                if self.near is not None:
                    for kind, found in asked.values():
                        if kind == HIT and found is not None:
                            self.near.put(*found)
                answers.update(asked)
            if self.stages is not None:
                self.stages.cache_lookup.observe(time.perf_counter() - start)
                if self.stages.lookups is not None and len(answers) > num_given:
                    _count_answers(self.stages.lookups, answers, given)
            for h, (kind, found) in answers.items():
                if kind == HIT and found is not None:
                    hits[h] = found
                else:
                    kinds[h] = kind
            return {h: meta for h, (meta, _) in hits.items()}

        return lookup

    async def prepare(
        self, request_id: str, messages: Sequence[Message], looked_up: LookedUp | None = None
    ) -> PreparedRequest:
        """Prompt ids and embedding refs for every media item of ``messages``. ``looked_up``: what
        the ingress's hit path found under ``request_id`` (its reservations are ours now)."""
        hits: dict[str, Found] = {}
        kinds: dict[str, CacheReply] = {}  # the non-hits: compute (reserved for us) or wait
        lookup = self._lookup(request_id, hits, kinds, looked_up)
        hashes = looked_up.hashes if looked_up is not None else None
        try:
            async with self._renewing(request_id, kinds):
                pre = await self.preprocessor.preprocess(messages, lookup, hashes=hashes)
                refs, num_encoded = await self._embeddings(request_id, pre, hits, kinds)
        except BaseException:
            if kinds:  # shielded: a cancelled caller must still give back what it reserved
                await asyncio.shield(self._release(request_id, list(kinds)))
            raise
        return _prepared(pre, refs, num_encoded)

    async def prepare_stream(
        self, request_id: str, messages: Sequence[Message], looked_up: LookedUp | None = None
    ) -> AsyncGenerator[PreparedRequest | list[MediaFeature], None]:
        """``prepare``, handed on as it goes: first the prompt ids and every item, those still being
        encoded (or computed by another request) without a ref; then, as each one's embeddings
        are committed, its items with their refs (every placeholder run of it), in the order they
        finish. Raises as ``prepare`` does (before the first frame for bad media or a full cache;
        after it when an encode fails), releasing what it reserved; leaving early cancels the
        encodes still queued."""
        if self.encode_each is None:
            raise RuntimeError("prepare_stream needs the encoder's per-item futures (encode_each)")
        hits: dict[str, Found] = {}
        kinds: dict[str, CacheReply] = {}
        lookup = self._lookup(request_id, hits, kinds, looked_up)
        hashes = looked_up.hashes if looked_up is not None else None
        futures: dict[str, asyncio.Future[Found]] = {}
        try:
            async with self._renewing(request_id, kinds):
                pre = await self.preprocessor.preprocess(messages, lookup, hashes=hashes)
                compute, wait = self._classify(pre, hits, kinds)
                if compute:
                    batch = EncodeBatch(request_id, [_encoder_input(it) for it in compute.values()])
                    for h, encoding in zip(compute, self.encode_each(batch), strict=True):
                        futures[h] = _found(encoding)
                for h, it in wait.items():
                    futures[h] = asyncio.ensure_future(self._wait_or_encode(request_id, it, kinds))
                first = _prepared(pre, hits, len(compute), partial=True)
                yield first
                runs: dict[str, list[MediaFeature]] = {}  # the placeholder runs still to come
                for item in first.items:
                    if not item.ref:
                        runs.setdefault(item.mm_hash, []).append(item)
                todo = set(futures.values())
                by_future = {f: h for h, f in futures.items()}
                while todo:
                    done, todo = await asyncio.wait(todo, return_when=asyncio.FIRST_COMPLETED)
                    ready = []
                    for finished in done:
                        meta, ref = finished.result()  # an encode that failed raises here
                        h = by_future[finished]
                        hits[h] = (meta, ref)
                        ready += [_placed(it, (meta, ref)) for it in runs[h]]
                    yield sorted(ready, key=lambda it: it.offset)
        except BaseException:
            for pending in futures.values():
                pending.cancel()
            if kinds:  # shielded: a cancelled caller must still give back what it reserved
                await asyncio.shield(self._release(request_id, list(kinds)))
            raise

    async def _wait_or_encode(self, request_id: str, it: MediaFeature, kinds: dict[str, CacheReply]) -> Found:
        """An item another request was computing: its result, or ours if it falls to us."""
        refs: dict[str, Found] = {}
        retry = await self._wait(request_id, it, refs)
        if retry is not None:
            kinds[retry.mm_hash] = COMPUTE
            await self._encode(request_id, [retry], refs)
        return refs[it.mm_hash]

    async def prepare_hits(
        self,
        request_id: str,
        messages: Sequence[Message],
        deferred: list[asyncio.Task[None]] | None = None,
    ) -> PreparedRequest | LookedUp:
        """The ingress's hit path: hash, name and look up (reserving the misses) without decoding
        anything. The prepared request when the cache holds every item; else what was found, for
        ``prepare`` on a replica that processes and encodes. The reservations go with it: a caller
        that fails before handing them on releases ``request_id`` itself. ``deferred``: see
        ``Preprocessor.preprocess`` (the uuid pointing, for the caller to await before answering)."""
        hits: dict[str, Found] = {}
        kinds: dict[str, CacheReply] = {}
        lookup = self._lookup(request_id, hits, kinds, None)
        try:
            pre = await self.preprocessor.preprocess(messages, lookup, process=False, deferred=deferred)
        except NeedsEncoding as e:
            found: dict[str, Answer] = {h: (HIT, f) for h, f in hits.items()}
            found.update((h, (kind, None)) for h, kind in kinds.items())
            return LookedUp(e.hashes, found)
        except BaseException:
            if kinds:
                await asyncio.shield(self._release(request_id, list(kinds)))
            raise
        return _prepared(pre, hits, 0)

    def remember(self, prepared: PreparedRequest, looked_up: LookedUp | None = None) -> None:
        """What a ``prepare`` reply says the index holds now, for the hit path's next requests. The
        items ``looked_up`` already answered as hits are not put again: the index did not see them
        there (a near-cache hit must not renew its own TTL)."""
        if self.near is None:
            return
        known = {h for h, (kind, _) in looked_up.found.items() if kind == HIT} if looked_up else set()
        refs = {it.mm_hash: it.ref[0] for it in prepared.items if it.ref}  # not those still encoding
        for meta in prepared.metas:
            if meta.mm_hash in refs and meta.mm_hash not in known:
                self.near.put(meta, refs[meta.mm_hash])

    def renewing(
        self, request_id: str, held: Mapping[str, str]
    ) -> contextlib.AbstractAsyncContextManager[None]:
        """Renew what ``request_id`` holds (``held``: mm_hash -> kind) while the caller waits."""
        return self._renewing(request_id, held)

    def sweep(self) -> None:
        """Release the near cache's expired entries (the ingress calls it every few seconds)."""
        if self.near is not None:
            self.near.purge()

    def forget(self, mm_hashes: list[str]) -> None:
        """Their objects were lost: never serve them from the near cache again."""
        if self.near is not None:
            self.near.drop(mm_hashes)

    @contextlib.asynccontextmanager
    async def _renewing(self, request_id: str, held: Mapping[str, str]) -> AsyncIterator[None]:
        """Renew the lease of what ``request_id`` reserved while it prepares. Only a slow request
        ever gets that far (the first renewal is ``lease_s / 3`` in), so until then this is a timer,
        not a task: a task per request would cost every request its start and its cancellation,
        two turns of a busy loop."""
        loop = asyncio.get_running_loop()
        renewer: asyncio.Task[None] | None = None

        async def renew_forever() -> None:
            while True:
                reserved = [h for h, kind in held.items() if kind == COMPUTE]
                if reserved:
                    try:
                        await self.cache.renew(request_id, reserved)
                    except Exception as e:  # the lease may run out: another request then computes it too
                        logger.warning("renewing the reservations of %s failed: %r", request_id, e)
                await asyncio.sleep(self.renew_every_s)

        def start() -> None:
            nonlocal renewer
            renewer = loop.create_task(renew_forever())

        timer = loop.call_later(self.renew_every_s, start)
        try:
            yield
        finally:
            timer.cancel()
            if renewer is not None:
                renewer.cancel()

    async def _release(self, request_id: str, hashes: list[str]) -> None:
        try:
            await self.cache.release(request_id, hashes or None)
        except Exception:
            logger.exception("releasing the encoder-cache reservations of %s failed", request_id)

    async def _embeddings(
        self, request_id: str, pre: PreprocessedRequest, hits: dict[str, Found], kinds: dict[str, CacheReply]
    ) -> tuple[dict[str, Found], int]:
        refs = dict(hits)  # mm_hash -> (meta, ref), the encodes and waits added below
        compute, wait = self._classify(pre, hits, kinds)
        num_encoded = await self._encode(request_id, list(compute.values()), refs)
        for retry in await gather(*(self._wait(request_id, it, refs) for it in wait.values())):
            if retry is not None:
                kinds[retry.mm_hash] = COMPUTE
                num_encoded += await self._encode(request_id, [retry], refs)
        return refs, num_encoded

    def _classify(
        self, pre: PreprocessedRequest, hits: dict[str, Found], kinds: dict[str, CacheReply]
    ) -> tuple[dict[str, MediaFeature], dict[str, MediaFeature]]:
        """The non-hits by mm_hash: reserved for us to compute, or computed by another request.
        Raises ``EncoderCacheFull`` for an item no shard can hold."""
        compute: dict[str, MediaFeature] = {}
        wait: dict[str, MediaFeature] = {}
        capacity = self.cache.shard_capacity
        for it in pre.items:
            if it.mm_hash in hits:
                continue
            # A run of a several-run item (a Qwen3-VL video frame) is charged the whole item's rows.
            rows = it.data.num_embeds if isinstance(it.data, EncoderInput) else it.length
            if capacity is not None and rows > capacity:
                raise EncoderCacheFull(
                    f"{it.modality} {it.index}: {rows} embeddings, more than an encoder-cache "
                    f"shard holds ({capacity}); raise encoder_cache_size or lower the media limits",
                    item=it.index,
                )
            (compute if kinds.get(it.mm_hash) == COMPUTE else wait).setdefault(it.mm_hash, it)
        return compute, wait

    async def _wait(self, request_id: str, it: MediaFeature, refs: dict[str, Found]) -> MediaFeature | None:
        """Another request was computing ``it``: its result, or ``it`` back if we must compute it."""
        start = time.perf_counter()
        kind, found = await self.cache.get_or_reserve(request_id, it.mm_hash)
        if self.stages is not None:
            self.stages.cache_wait.observe(time.perf_counter() - start, mm_hash=it.mm_hash)
        if kind == HIT and found is not None:
            refs[it.mm_hash] = found
            return None
        return it

    async def _encode(self, request_id: str, items: list[MediaFeature], refs: dict[str, Found]) -> int:
        if not items:
            return 0
        encoded = await self.encode(EncodeBatch(request_id, [_encoder_input(it) for it in items]))
        for out in encoded:
            refs[out.meta.mm_hash] = (out.meta, out.ref[0])
        return len(encoded)


def _count_answers(lookups: CacheLookups, answers: dict[str, Answer], given: LookedUp | None) -> None:
    """Count the answers this lookup got itself (near cache or shard), not the ones ``given``."""
    for h, (kind, _) in answers.items():
        if given is not None and h in given.found:
            continue
        if kind == HIT:
            lookups.hit.inc()
        elif kind == COMPUTE:
            lookups.miss.inc()
        else:
            lookups.wait.inc()


def _encoder_input(it: MediaFeature) -> EncoderInput:
    if not isinstance(it.data, EncoderInput):  # processed items always carry it: a bug, not bad input
        raise RuntimeError(f"{it.modality} {it.index} was not processed but must be encoded")
    return it.data


def _found(fut: asyncio.Future[EncodedItem]) -> asyncio.Future[Found]:
    """An encode's future as (meta, ref); cancelling it cancels the encode's."""

    async def found() -> Found:
        out = await fut
        return out.meta, out.ref[0]

    task = asyncio.ensure_future(found())
    task.add_done_callback(lambda t: fut.cancel() if t.cancelled() else None)
    return task


def _items(pre: PreprocessedRequest, found: dict[str, Found], partial: bool = False) -> list[MediaFeature]:
    """Every placeholder run with its ref; ``partial``: where ``found`` has it (else none: to come)."""
    if not partial and (missing := [it.mm_hash for it in pre.items if it.mm_hash not in found]):
        raise RuntimeError(f"prepared without the embeddings of {missing}")  # a bug, not bad input
    return [_placed(it, found[it.mm_hash]) if it.mm_hash in found else it.encoded() for it in pre.items]


def _placed(it: MediaFeature, found: Found) -> MediaFeature:
    """The record with where its embeddings are: the entry's ref and its part of that object."""
    meta, ref = found
    return it.encoded([ref], meta.part)


def _prepared(
    pre: PreprocessedRequest, found: dict[str, Found], num_encoded: int, partial: bool = False
) -> PreparedRequest:
    metas = [meta for meta, _ in found.values()]
    items = _items(pre, found, partial)
    return PreparedRequest(list(pre.prompt_token_ids), items, num_encoded, pre.to_log(), metas)
