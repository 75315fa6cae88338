"""``PrepareCalls``: how the ingress gets one media request prepared, whatever fails on the way.

The first attempt tries the hit path (``HitPath.prepare_hits``): a request whose every item the
encoder cache holds is prepared here, with no call but the lookup. Otherwise (or when the hit path
fails on our side, a cache shard restarting) ``prepare`` goes to a preparing replica, with what the
lookup found and reserved, whose leases are renewed while the replica works. A replica that dies
while preparing: the attempt's reservations are released on every shard (final there: a reservation
arriving later is refused) and the request is sent again under a fresh attempt id, up to
``PREPARE_ATTEMPTS`` times.

It also keeps the work the hit path started that nothing waits on (pointing uuids at their bytes):
``settle`` awaits it before the request's last output goes out.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator, Sequence

from encoder_service.preprocess import tracing
from encoder_service.preprocess.prepared import LookedUp, PreparedRequest
from mmcore.feature import MediaFeature
from router.journey.model_handles import ModelHandles
from router.protocol.errors import is_client_error, replica_gone
from router.protocol.messages import NormalizedMessage, inline_media

logger = logging.getLogger("mmserve.router")

Arrivals = AsyncGenerator[list[MediaFeature], None]  # a request's items as their encodes commit

PREPARE_ATTEMPTS = 3  # a replica that dies while preparing a request: prepared again on another
HIT_PATH_MAX_CHARS = 4 << 20  # inline media past this is hashed by the preparing replica, off this loop
NEAR_SWEEP_S = 5.0  # how often the near cache's expired entries are released
SETTLE_TIMEOUT_S = 5.0  # the most a deferred uuid pointing may hold a request's last output


class PrepareCalls:
    def __init__(self, handles: ModelHandles) -> None:
        self.handles = handles
        self.hit_path_served = 0  # media requests prepared at the ingress alone (all cache hits)
        self._deferred: dict[str, list[asyncio.Task[None]]] = {}  # work to finish before answering
        self._sweeper: asyncio.Task[None] | None = None  # the near cache's expiry (_ensure_sweeper)

    async def call(
        self,
        request_id: str,
        attempt_id: str,
        messages: Sequence[NormalizedMessage],
    ) -> PreparedRequest:
        """``messages`` prepared: by the hit path, or by ``prepare`` on a replica (sent again while
        the replica preparing it dies: Serve routes the next to a live one or its successor)."""
        pre, _ = await self._call(request_id, attempt_id, messages, overlap=False)
        return pre

    async def call_overlapped(
        self, request_id: str, attempt_id: str, messages: Sequence[NormalizedMessage]
    ) -> tuple[PreparedRequest, Arrivals | None]:
        """``call``, answered as soon as the prompt is known: items still encoding come without a
        ref, and the returned stream (None: nothing to come) yields them as they are committed. Its
        consumer closes it (which cancels what is left on the replica) and, if it fails, releases
        ``attempt_id``'s reservations (``release``)."""
        return await self._call(request_id, attempt_id, messages, overlap=True)

    async def _call(
        self, request_id: str, attempt_id: str, messages: Sequence[NormalizedMessage], overlap: bool
    ) -> tuple[PreparedRequest, Arrivals | None]:
        use_hit_path = self.handles.hit_path is not None and inline_media(messages, HIT_PATH_MAX_CHARS)
        if use_hit_path:
            self._ensure_sweeper()
        for attempt in range(1, PREPARE_ATTEMPTS + 1):
            aid = attempt_id if attempt == 1 else f"{attempt_id}#p{attempt}"
            from_hit_path = False
            try:
                looked_up: LookedUp | None = None
                if use_hit_path and attempt == 1 and self.handles.hit_path is not None:
                    from_hit_path = True
                    deferred: list[asyncio.Task[None]] = []
                    try:
                        got = await self.handles.hit_path.prepare_hits(aid, messages, deferred)
                    finally:
                        self._defer(request_id, deferred)
                    if isinstance(got, PreparedRequest):
                        self.hit_path_served += 1
                        return got, None
                    looked_up, from_hit_path = got, False
                trace = tracing.headers()  # a sampled request's trace, to the replica
                if looked_up is None:
                    pre, rest = await self._prepare(aid, messages, None, trace, attempt == 1, overlap)
                else:  # its reservations are ours until the replica takes them: renewed meanwhile
                    assert self.handles.hit_path is not None
                    held = {h: kind for h, (kind, _) in looked_up.found.items()}
                    async with self.handles.hit_path.renewing(aid, held):
                        pre, rest = await self._prepare(
                            aid, messages, looked_up, trace, attempt == 1, overlap
                        )
                if self.handles.hit_path is not None:
                    self.handles.hit_path.remember(pre, looked_up)
                return pre, rest
            except BaseException as e:
                # The replica may still be running (a cancel need not reach it): release on every
                # shard. Final there: its later reservations are refused.
                await asyncio.shield(self._release(aid))
                # The hit path failing on our side (a cache shard restarting) costs the shortcut,
                # not the request: the next attempt prepares it on a replica.
                retry = replica_gone(e) or (from_hit_path and not is_client_error(e))
                if attempt == PREPARE_ATTEMPTS or isinstance(e, asyncio.CancelledError) or not retry:
                    raise
                if from_hit_path:
                    logger.warning("hit path failed for %s (%r); preparing it on a replica", request_id, e)
                    continue
                logger.warning(
                    "replica preparing %s lost (%s); preparing it again", request_id, type(e).__name__
                )
                await asyncio.sleep(0.2 * attempt)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _prepare(
        self,
        aid: str,
        messages: Sequence[NormalizedMessage],
        looked_up: LookedUp | None,
        trace: dict[str, str] | None,
        via_link: bool,
        overlap: bool,
    ) -> tuple[PreparedRequest, Arrivals | None]:
        if not overlap:
            return await self.handles.prepare(
                aid, messages, looked_up=looked_up, trace_headers=trace, via_link=via_link
            ), None
        frames = self.handles.prepare_stream(
            aid, messages, looked_up=looked_up, trace_headers=trace, via_link=via_link
        )
        try:
            first = await anext(frames)
        except BaseException:
            await frames.aclose()
            raise
        if not isinstance(first, PreparedRequest):
            await frames.aclose()
            raise TypeError(f"prepare_stream began with {type(first).__name__}, not the prepared request")
        if all(it.ref for it in first.items):  # all hits: nothing to come
            await frames.aclose()
            return first, None
        return first, frames  # type: ignore[return-value]  # the rest are item lists

    async def release(self, attempt_id: str) -> None:
        """Give back what ``attempt_id`` reserved, on every shard (final there); never raises."""
        await self._release(attempt_id)

    async def settle(self, request_id: str) -> None:
        """Finish what the request's answer must not go out before (its uuid pointing); the ingress
        calls it before any chunk that carries a finish reason."""
        tasks = list(self._deferred.get(request_id, ()))
        if tasks:  # failures are logged by _log_failure; one that hangs does not hold the answer
            _, pending = await asyncio.wait(tasks, timeout=SETTLE_TIMEOUT_S)
            if pending:
                logger.warning(
                    "request %s answered with %d uuid pointing(s) unfinished", request_id, len(pending)
                )

    def stats(self) -> dict[str, object]:
        near = getattr(self.handles.hit_path, "near", None)
        return {"hit_path_served": self.hit_path_served, "near_cache": near.stats() if near else None}

    async def _release(self, attempt_id: str) -> None:
        try:
            await self.handles.cache.release(attempt_id)
        except Exception:  # never let cleanup mask the original error
            logger.exception("releasing the encoder-cache reservations of %s failed", attempt_id)

    def _ensure_sweeper(self) -> None:
        """Every ``NEAR_SWEEP_S``, the hit path's near cache lets go of its expired entries."""
        if self._sweeper is not None and not self._sweeper.done():
            return

        async def sweep_forever() -> None:
            while True:
                await asyncio.sleep(NEAR_SWEEP_S)
                if self.handles.hit_path is not None:
                    self.handles.hit_path.sweep()

        self._sweeper = asyncio.get_running_loop().create_task(sweep_forever())

    def _defer(self, request_id: str, tasks: list[asyncio.Task[None]]) -> None:
        """Work the hit path started that nothing waits on (pointing uuids at bytes): awaited before
        the request's last output goes out, so a client that saw the answer finds it done."""
        for task in tasks:
            task.add_done_callback(_log_failure)
            task.add_done_callback(functools.partial(self._undefer, request_id))
            self._deferred.setdefault(request_id, []).append(task)

    def _undefer(self, request_id: str, task: asyncio.Task[None]) -> None:
        """A finished task leaves the books (bounded even for a response dropped before its body)."""
        tasks = self._deferred.get(request_id)
        if tasks is not None and task in tasks:
            tasks.remove(task)
            if not tasks:
                del self._deferred[request_id]


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (e := task.exception()) is not None:
        logger.warning("pointing media uuids at their bytes failed: %r", e)
