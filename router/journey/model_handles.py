"""What the ingress holds of one model's pools: ``ModelHandles``, and the protocols of the parts the
router calls (the encoder pool, which prepares, the shared encoder-cache index, the hit path). ``cluster/app.py``
fills it with Serve handles, shard clients and links; the unit tests with in-process fakes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from encoder_service.preprocess.prepared import LookedUp, PreparedRequest
from mmcore.feature import MediaFeature
from mmcore.link.pool_links import PoolLinks
from router.journey.llm_client import LLMClient, counters_or_error
from router.journey.serve_calls import Counters, StreamingMethod, UnaryMethod
from router.protocol.messages import NormalizedMessage

PrepareFrame = PreparedRequest | list[MediaFeature]  # ``prepare_stream``'s: the request, then items


class StreamingEncoderPool(Protocol):
    @property
    def prepare_stream(self) -> StreamingMethod[PrepareFrame]: ...


class EncoderPool(Protocol):
    """The encoder pool as the router calls it (a Serve DeploymentHandle in production), its
    methods those of ``encoder_service.serve.deployment.EncoderServer``."""

    @property
    def prepare(self) -> UnaryMethod[PreparedRequest]: ...

    @property
    def stats(self) -> UnaryMethod[Counters]: ...

    def options(self, *, stream: bool) -> StreamingEncoderPool: ...


class CacheIndex(Protocol):
    """The shared encoder cache as the router uses it (encoder_service.cache.cache_client.EncoderCacheClient)."""

    async def release(self, request_id: str, hashes: list[str] | None = None) -> None: ...

    async def invalidate(self, mm_hashes: list[str], ref_ids: dict[str, str] | None = None) -> list[str]: ...


class HitPath(Protocol):
    """Preparing at the ingress what the encoder cache holds whole (encoder_service.preprocess.prepare.RequestPreparer)."""

    async def prepare_hits(
        self, request_id: str, messages: Sequence[NormalizedMessage], deferred: list[asyncio.Task[None]]
    ) -> PreparedRequest | LookedUp: ...

    def remember(self, prepared: PreparedRequest, looked_up: LookedUp | None = None) -> None: ...

    def renewing(
        self, request_id: str, held: Mapping[str, str]
    ) -> contextlib.AbstractAsyncContextManager[None]: ...

    def sweep(self) -> None: ...

    def forget(self, mm_hashes: list[str]) -> None: ...


@dataclass
class ModelHandles:
    encoder: EncoderPool
    llm: LLMClient
    cache: CacheIndex
    hit_path: HitPath | None = None  # None: every media request goes to ``prepare``
    encoder_links: PoolLinks | None = (
        None  # ``prepare`` as frames to the pool's replicas (mmcore/link/pool_links.py)
    )

    async def prepare(
        self,
        request_id: str,
        messages: Sequence[NormalizedMessage],
        *,
        looked_up: LookedUp | None = None,
        trace_headers: dict[str, str] | None = None,
        via_link: bool = True,
    ) -> PreparedRequest:
        """One ``prepare`` call to the encoder pool (``EncoderServer.prepare``):
        ``looked_up``, what the hit path found and reserved; ``trace_headers``, a sampled request's
        trace context. Over the direct link of the replica its router chooses, if one is up; a
        retry (``via_link=False``) goes through Serve, which waits for a live replica."""
        args = _prepare_args(request_id, messages, looked_up, trace_headers)
        links = self.encoder_links
        picked = links.pick(*args) if via_link and links is not None else None
        if picked is None:
            return await self.encoder.prepare.remote(*args)
        assert links is not None
        uid, link = picked
        links.routed(request_id, uid, *args)
        try:
            prepared: PreparedRequest = await link.call("prepare", *args)
        finally:
            links.done(request_id)
        return prepared

    async def prepare_stream(
        self,
        request_id: str,
        messages: Sequence[NormalizedMessage],
        *,
        looked_up: LookedUp | None = None,
        trace_headers: dict[str, str] | None = None,
        via_link: bool = True,
    ) -> AsyncGenerator[PrepareFrame, None]:
        """``prepare_stream`` on a preparing replica (as ``prepare`` picks it): the prepared request,
        its items still encoding without refs, then those items as they are committed. Leaving
        early cancels it there (its reservations are released, its queued encodes dropped)."""
        args = _prepare_args(request_id, messages, looked_up, trace_headers)
        links = self.encoder_links
        picked = links.pick(*args) if via_link and links is not None else None
        if picked is None:
            call = self.encoder.options(stream=True).prepare_stream.remote(*args)
            try:
                async for frame in call:
                    yield frame
            finally:
                call.cancel()
            return
        assert links is not None
        uid, link = picked
        links.routed(request_id, uid, *args)
        try:
            async with contextlib.aclosing(link.stream("prepare_stream", *args)) as frames:
                async for frame in frames:
                    yield frame
        finally:
            links.done(request_id)

    async def pool_stats(self, timeout_s: float = 5.0) -> dict[str, object]:
        """The pools' own counters: the preparing replica Serve picks (queued encoder work, inline
        values sent, processor cache) and every LLM replica this ingress reads from
        (running, waiting, KV blocks, prefix hits). A pool that does not answer reports its error."""
        preparing = await counters_or_error(self.encoder.stats.remote(), timeout_s)
        return {"preparing_replica": preparing, "llm_replicas": await self.llm.replica_stats(timeout_s)}


def _prepare_args(
    request_id: str,
    messages: object,
    looked_up: LookedUp | None,
    trace_headers: dict[str, str] | None,
) -> tuple[object, ...]:
    """``prepare``'s arguments, positional (a direct link's frames carry no keywords, and the
    routers read them by position), the trailing defaults left off: the replica's
    ``prepare(request_id, messages, looked_up=None, trace_headers=None)``."""
    if trace_headers is not None:
        return (request_id, messages, looked_up, trace_headers)
    if looked_up:
        return (request_id, messages, looked_up)
    return (request_id, messages)
