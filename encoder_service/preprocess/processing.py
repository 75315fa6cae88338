"""``Preprocessor``: OpenAI-style messages → prompt token ids with expanded placeholders + encoder inputs.

    messages ──▶ media refs ──fetch──▶ original bytes ──▶ mm_hash ──lookup──▶ hit: meta from the cache
                                                                         └──▶ miss: decode → HF processor
    chat template ──▶ tokenize ──▶ expand each placeholder id to the item's num_embeds ──▶ PlaceholderRange

An item the encoder cache holds is never decoded nor processed: its length and grid come from the
cache entry. Only misses carry an ``EncoderInput``.

mm_hashes name content only. A ``uuid`` is a name in the sender's tenant namespace
(encoder_service/cache/uuid_aliases.py): sent with bytes, it is pointed at their mm_hash; sent alone, it
resolves to the mm_hash it was last pointed at by that tenant, and an unknown name is a 400.

Images: the header is opened and checked once (formats, pixels, the processor's size rules) before
any lookup; a miss is decoded from that same opened file — a JPEG at reduced scale when the processor
shrinks it ≥ 2× anyway — and goes through the family's own fast transform (HF's floats, fewer copies).
Bad bytes are the client's 4xx naming the item (``errors.decoding``, ``errors.processed_or_422``).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import cast

from encoder_service.cache.uuid_aliases import AliasStore, LocalAliases
from encoder_service.preprocess.errors import (
    InvalidMediaInput,
    MediaDecodeError,
    MMCacheMiss,
    processed_or_422,
)
from encoder_service.preprocess.gathering import gather
from encoder_service.preprocess.hashing import canonical_kwargs, compute_mm_hash, uuid_alias_key
from encoder_service.preprocess.hit_path_facts import HitPathFacts, read_hit_path_facts
from encoder_service.preprocess.media.fetch import FetchedMedia, fetch_media_bytes, inline_media_bytes
from encoder_service.preprocess.media.image import decode_opened, image_header
from encoder_service.preprocess.media.limits import MediaLimits
from encoder_service.preprocess.media.loader import decode_media
from encoder_service.preprocess.media.pinned_client import PinnedClient
from encoder_service.preprocess.media.url_safety import Resolver, resolve_host
from encoder_service.preprocess.media_items import MediaItem, Message, collect_media
from encoder_service.preprocess.processor_cache import ProcessorCache
from encoder_service.preprocess.processors import FamilyProcessor, ProcessedItem, load_family_processor
from encoder_service.preprocess.processors.base import PromptFamily
from encoder_service.preprocess.prompt_tokens import render_prompt, text_chars
from encoder_service.preprocess.stage_timing import MediaStages
from encoder_service.types import (
    MODALITIES,
    EmbeddingMeta,
    EncoderInput,
    MediaRef,
    Modality,
    PreprocessedRequest,
)
from mmcore.chat_template import template_takes_tools
from mmcore.feature import ItemFacts

INLINE_TEMPLATE_CHARS = 16_384  # prompts with more text are templated and tokenized on a worker thread
Lookup = Callable[[list[str]], "dict[str, EmbeddingMeta] | Awaitable[dict[str, EmbeddingMeta]]"]


class NeedsEncoding(Exception):
    """``preprocess(process=False)`` met an item the encoder cache does not hold (not a client error)."""

    def __init__(self, hashes: list[str]) -> None:
        super().__init__(f"{len(hashes)} media item(s), some not in the encoder cache")
        self.hashes = hashes  # every item's mm_hash, in order


class Preprocessor:
    """One model's preprocessing. Safe to share across coroutines; the HF processor runs in threads."""

    def __init__(
        self,
        model_dir: str | Path,
        limits: MediaLimits | None = None,
        limit_mm_per_prompt: dict[str, int] | None = None,
        processor_cache_bytes: int = 256 * 1024 * 1024,
        *,
        model_id: str | None = None,
        resolver: Resolver = resolve_host,
        http_client: PinnedClient | None = None,
        aliases: AliasStore | None = None,
        stages: MediaStages | None = None,
        chat_template: str | None = None,
        family: PromptFamily | None = None,
    ) -> None:
        """``family``: the ingress's ``HitPathFamily`` (which processes nothing); None: the adapter
        over the model's loaded HF processor."""
        self.limits = limits or MediaLimits()
        self.stages = stages  # fetch, decode and processor timings (stage_timing.py); None: not timed
        self.facts: HitPathFacts = read_hit_path_facts(model_dir)  # what the mm_hash covers
        self.family: PromptFamily = family or load_family_processor(model_dir, self.limits)
        if chat_template is not None:  # the model's override (config ``chat_template``), as the ingress's
            self.family.hf.chat_template = chat_template
        self.model_id = model_id or Path(model_dir).name
        limit = (
            limit_mm_per_prompt if limit_mm_per_prompt is not None else {m: 1 for m in self.family.modalities}
        )
        self.limit_mm_per_prompt = {
            m: (limit.get(m, 0) if m in self.family.modalities else 0) for m in MODALITIES
        }
        self.processor_cache = ProcessorCache(processor_cache_bytes)
        self.num_processor_calls = 0  # HF processor invocations, for tests and metrics
        self._resolver = resolver
        self._http = http_client
        self.aliases: AliasStore = aliases or LocalAliases()  # uuid names; shared ones when serving
        self._kwargs_bytes: dict[Modality, tuple[dict[str, object], bytes]] = {}

    # ---- family facts the router and engine need -----------------------------------------------------
    @property
    def placeholder_token_ids(self) -> dict[Modality, int]:
        return dict(self.family.placeholder_token_ids)

    @property
    def uses_mrope(self) -> bool:
        return self.family.uses_mrope

    @property
    def sampling_rate(self) -> int | None:
        return self.family.sampling_rate

    @property
    def modalities(self) -> tuple[Modality, ...]:
        return self.family.modalities

    def mm_hash(self, modality: Modality, data: bytes) -> str:
        """Over the item's ORIGINAL bytes and every processor setting that changes its encoding."""
        return compute_mm_hash(self.model_id, modality, data, self._hash_kwargs_bytes(modality))

    def uuid_key(self, ref: MediaRef) -> str:
        """The key of ``ref``'s uuid in its sender's namespace."""
        assert ref.uuid is not None
        return uuid_alias_key(self.model_id, ref.modality, ref.tenant, ref.uuid)

    def hash_kwargs(self, modality: Modality) -> dict[str, object]:
        """Every setting that changes how an item of ``modality`` is encoded: the processor's as
        written in the model's files (with the versions that fix its defaults), the sampling and
        decode settings; the same with or without the processor loaded (``HitPathFacts``)."""
        return {**self.facts.hash_kwargs(modality, self.limits), **self.family.decode_kwargs(modality)}

    def _hash_kwargs_bytes(self, modality: Modality) -> bytes:
        """The canonical JSON of the hash kwargs, re-encoded only when a setting changed."""
        kwargs = self.hash_kwargs(modality)
        cached = self._kwargs_bytes.get(modality)
        if cached is None or cached[0] != kwargs:
            cached = (copy.deepcopy(kwargs), canonical_kwargs(kwargs))
            self._kwargs_bytes[modality] = cached
        return cached[1]

    # ---- the pipeline --------------------------------------------------------------------------------
    async def preprocess(
        self,
        messages: Sequence[Message],
        lookup: Lookup | None = None,
        *,
        hashes: list[str] | None = None,
        process: bool = True,
        deferred: list[asyncio.Task[None]] | None = None,
    ) -> PreprocessedRequest:
        """``hashes``: the items' mm_hashes, in order, computed and named already (by the ingress's
        hit path). ``process=False``: raise ``NeedsEncoding`` instead of processing a miss.
        ``deferred``: pointing uuids at their bytes (which nothing here waits on) is started as a
        task appended to it, for the caller to await before it answers, instead of awaited here."""
        template_messages, items = collect_media(messages, self.limit_mm_per_prompt, self.model_id)
        # Inline bytes are taken here, in order: a task per item would cost this request two turns
        # of a busy loop (13 ms p50 of a warm image's 90 ms TTFT at c=8 here) for no I/O at all.
        pending = [it for it in items if not self._take_inline(it)]
        if pending:
            await gather(*(self._fetch(it) for it in pending))
        pointing = None
        if hashes is not None:
            if len(hashes) != len(items):
                raise RuntimeError(f"{len(hashes)} mm_hashes given for {len(items)} media items")
            for it, mm_hash in zip(items, hashes, strict=True):
                it.mm_hash = mm_hash
        else:
            for it in items:
                if it.fetched is not None:
                    it.mm_hash = self.mm_hash(it.ref.modality, it.fetched.data)
            pointing = await self._name_uuids(items)
        if pointing is not None and deferred is not None:
            deferred.append(asyncio.ensure_future(pointing))
            pointing = None
        if pointing is None:
            cached = await self._lookup(lookup, items)
        else:  # nothing waits on the pointing: it goes beside the lookup, not before it
            cached, _ = await asyncio.gather(self._lookup(lookup, items), pointing)
        return await self._finish(template_messages, items, cached, process)

    async def _finish(
        self,
        template_messages: Sequence[Mapping[str, object]],
        items: list[MediaItem],
        cached: dict[str, EmbeddingMeta],
        process: bool,
    ) -> PreprocessedRequest:
        """Fill each item from the cache's answer or process it; template and tokenize."""
        computed: dict[str, MediaItem] = {}
        misses = []
        for it in sorted(items, key=lambda it: it.fetched is None):  # bytes first: a uuid alone may name them
            meta = cached.get(it.mm_hash)
            if meta is not None:
                it.facts, it.metadata = meta.facts, {"source": "encoder_cache"}
            elif it.mm_hash in computed:
                continue  # filled in from the first item with these bytes, below
            elif it.fetched is None:
                raise MMCacheMiss(
                    f"{it.ref.modality} {it.index}: uuid {it.ref.uuid!r} is not in the encoder cache; "
                    "send the media data with it",
                    item=it.index,
                )
            else:
                computed[it.mm_hash] = it
                misses.append(it)
        if misses and not process:
            raise NeedsEncoding([it.mm_hash for it in items])
        await gather(*(asyncio.to_thread(self._process, it) for it in misses))
        for it in items:
            first = computed.get(it.mm_hash)
            if first is not None and first is not it:
                it.facts, it.encoder_input, it.metadata = first.facts, first.encoder_input, first.metadata
        if text_chars(template_messages) > INLINE_TEMPLATE_CHARS:  # not on the caller's loop
            return await asyncio.to_thread(self._tokenize, template_messages, items)
        return self._tokenize(template_messages, items)

    def preprocess_sync(
        self,
        messages: Sequence[Message],
        lookup: Lookup | None = None,
    ) -> PreprocessedRequest:
        """``preprocess`` for callers without an event loop.

        The coroutine hands its result out through a list: Python 3.11's ``asyncio.run`` formats the
        main task's repr (result included, so every tensor's repr) twice on the way out, which cost
        more than the HF processor itself for a 720p image."""
        box: list[PreprocessedRequest] = []

        async def run() -> None:
            box.append(await self.preprocess(messages, lookup))

        asyncio.run(run())
        return box[0]

    def _take_inline(self, it: MediaItem) -> bool:
        """Fill ``it`` if that needs no I/O (its bytes inline, or none: a uuid alone)."""
        ref = it.ref
        if ref.data is None and ref.url is None:
            if ref.uuid is None:
                raise InvalidMediaInput(f"{ref.modality} {it.index}: no data, url or uuid", item=it.index)
            return True
        fetched = inline_media_bytes(ref, self.limits, item=it.index)
        if fetched is None:
            return False
        self._fetched(it, fetched)
        return True

    async def _fetch(self, it: MediaItem) -> None:
        start = time.perf_counter()
        fetched = await fetch_media_bytes(
            it.ref, self.limits, item=it.index, client=self._http, resolver=self._resolver
        )
        if self.stages is not None:
            self.stages.fetch.observe(time.perf_counter() - start)
        self._fetched(it, fetched)

    def _fetched(self, it: MediaItem, fetched: FetchedMedia) -> None:
        it.fetched = fetched
        if fetched.source == "data_url":
            it.keep_bytes(fetched.data)
        ref = it.ref
        if ref.modality == "image":  # header-only checks, also for items the cache will serve
            it.header = image_header(it.fetched.data, self.limits, item=it.index, label=f"image {it.index}")
            try:
                self.family.check_image_size(*it.header.size)
            except ValueError as e:
                raise MediaDecodeError(f"image {it.index}: {e}", item=it.index) from e

    async def _name_uuids(self, items: list[MediaItem]) -> Awaitable[None] | None:
        """Point each uuid sent with bytes at their mm_hash; resolve each uuid sent alone (the same
        request's own bytes first). Both in the sender's namespace only. When nothing is resolved,
        the pointing is returned unsent, for the caller to send beside its lookup."""
        named = {self.uuid_key(it.ref): it.mm_hash for it in items if it.ref.uuid and it.fetched}
        tenant = items[0].ref.tenant if items else None  # one request: one tenant
        alone = {it.index: self.uuid_key(it.ref) for it in items if it.fetched is None}
        wanted = [k for k in dict.fromkeys(alone.values()) if k not in named]
        found: dict[str, str] = {}
        pointing = None
        if named and wanted:
            _, found = await asyncio.gather(self.aliases.point(named, tenant), self.aliases.resolve(wanted))
        elif named:  # every name sent alone is one of these bytes': nothing to wait for
            pointing = self.aliases.point(named, tenant)
        elif wanted:
            found = await self.aliases.resolve(wanted)
        found.update(named)
        for it in items:
            if it.fetched is not None:
                continue
            mm_hash = found.get(alone[it.index])
            if mm_hash is None:
                raise MMCacheMiss(
                    f"{it.ref.modality} {it.index}: uuid {it.ref.uuid!r} is not in the encoder cache; "
                    "send the media data with it",
                    item=it.index,
                )
            it.mm_hash = mm_hash
        return pointing

    async def _lookup(self, lookup: Lookup | None, items: list[MediaItem]) -> dict[str, EmbeddingMeta]:
        if lookup is None or not items:
            return {}
        result = lookup(list(dict.fromkeys(it.mm_hash for it in items)))
        if inspect.isawaitable(result):
            result = await result
        return dict(result)

    def _process(self, it: MediaItem) -> None:
        """Decode and run the HF processor for one miss, through the processor cache."""
        modality = it.ref.modality
        hit = self.processor_cache.get(it.mm_hash)
        if hit is not None:
            it.encoder_input, it.facts, it.metadata = hit, hit.facts, {"source": "processor_cache"}
            return
        fetched = it.fetched
        assert fetched is not None
        family = self.processor
        seconds: float | None = None  # a video's, from its decode
        times: list[float] | None = None
        if modality == "image":
            out, it.metadata = self._process_image(it)
        else:
            start = time.perf_counter()
            loaded = decode_media(  # maps every decoder exception to a 4xx naming the item
                modality,
                fetched,
                self.limits,
                item=it.index,
                sampling_rate=family.sampling_rate or 16000,
                frame_multiple=family.frame_multiple,
            )
            decoded_at = time.perf_counter()
            self.num_processor_calls += 1
            out = processed_or_422(lambda: family.process(modality, loaded.value), modality, it.index)
            self._observe_processing(it, start, decoded_at)
            meta = it.metadata = {**loaded.metadata, **family.item_metadata(modality, loaded.metadata)}
            seconds = cast("float | None", meta.get("second_per_grid_ts"))  # the family's facts
            times = cast("list[float] | None", meta.get("frame_times"))
        it.facts = ItemFacts(out.num_embeds, out.grid_thw, seconds, times)
        it.encoder_input = EncoderInput.of(it.mm_hash, modality, it.facts, out.tensors)
        self.processor_cache.put(it.encoder_input)

    def _process_image(self, it: MediaItem) -> tuple[ProcessedItem, dict[str, object]]:
        """Decode (at reduced scale when the processor shrinks the image that much anyway) and process."""
        assert it.fetched is not None and it.header is not None
        header, it.header = it.header, None  # opened and checked by ``_fetch``; decoded once, here
        family = self.processor
        start = time.perf_counter()
        min_size = family.image_decode_size(*header.size)
        decoded = decode_opened(header, min_size=min_size, item=it.index, label=f"image {it.index}")
        decoded_at = time.perf_counter()
        self.num_processor_calls += 1
        out = processed_or_422(lambda: family.process_image(decoded), "image", it.index)
        self._observe_processing(it, start, decoded_at)
        meta: dict[str, object] = {
            "source": it.fetched.source,
            "num_bytes": len(it.fetched.data),
            **decoded.metadata(),
        }
        if decoded.reduced:
            meta["decoded_size"] = list(decoded.image.size)
        return out, meta

    @property
    def processor(self) -> FamilyProcessor:
        """The family's adapter over the loaded HF processor (an encoder's; the hit path has none)."""
        if not isinstance(self.family, FamilyProcessor):  # the hit path raises NeedsEncoding before
            raise RuntimeError(f"{type(self.family).__name__} processes no media (the ingress's hit path)")
        return self.family

    def _observe_processing(self, it: MediaItem, start: float, decoded_at: float) -> None:
        if self.stages is not None:
            now = time.perf_counter()
            self.stages.media_decode.observe(decoded_at - start, ago=now - decoded_at, mm_hash=it.mm_hash)
            self.stages.preprocess.observe(now - decoded_at, mm_hash=it.mm_hash)

    @functools.cached_property
    def _template_takes_tools(self) -> bool:
        return template_takes_tools(getattr(self.family.hf, "chat_template", None))

    def _tokenize(
        self, template_messages: Sequence[Mapping[str, object]], items: list[MediaItem]
    ) -> PreprocessedRequest:
        return render_prompt(self.family, self.model_id, template_messages, items, self._template_takes_tools)
