"""E/P/D at the ingress: a request's prompt on a prefill replica, its decode on a decode replica.

``PDClient.submit(spec)`` calls ``prefill`` on a prefill replica, routed by prefix affinity (the pool's
``PrefixAffinityRouter``, over the replica's direct link or Serve's handle): the replica computes the
prompt and the first token and answers a ``KVHandoff`` (llm_service/kv_handoff.py). Unless the first
token ended the request, the spec goes on with the hand-off to a decode replica (the decode pool's
``FreeKVRouter``: free KV and load), which pulls the KV from the prefill replica and streams the
tokens, the first included, on its output channel: the rest is ``LLMClient``'s. The decode replica
never sees a media item's bytes or embeddings, only the items' positions and hashes.

Failure: a prefill replica lost before its answer → prefilled again (another replica, or its
successor, within ``reroute_timeout_s``); a transfer that fails (the prefill replica died or let its
pin go: ``kv_transfer_failed``; the decode replica freed what it allocated) → prefilled again once;
a decode replica lost before the request's first output → prefilled again and sent to another;
a decode replica short of what the import needs (``DecodeRefused``: nothing allocated, the prefill
replica's pin stands) → the same hand-off to another decode replica, the refusing ones last; when
every one refused (or the hand-off failed otherwise), the prefill replica is told to let its pin go
at once (``abort``), and the client gets the retryable 503 (its retry prefills again, mostly from that
replica's prefix cache, where the freed blocks stay).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Protocol

from llm_service.kv_handoff import KVHandoff
from llm_service.outputs import RequestOutput
from llm_service.request_spec import LLMRequestSpec, ReplicaTarget, SubmitReply
from mmcore.link.pool_links import PoolLinks
from router.journey.llm_client import MAX_REPLICAS_LISTED, LLMClient, LLMPool, counters_or_error
from router.journey.serve_calls import Counters, UnaryMethod
from router.protocol.errors import replica_gone

logger = logging.getLogger("mmserve.router")


class PrefillPool(Protocol):
    """The prefill pool as the router calls it (``llm_service.serve.deployment.LLMServer.prefill``)."""

    @property
    def prefill(self) -> UnaryMethod[KVHandoff]: ...

    @property
    def stats(self) -> UnaryMethod[Counters]: ...

    @property
    def abort(self) -> UnaryMethod[None]: ...


MAX_DECODE_TRIES = 4  # decode replicas asked in turn while they refuse an import as overloaded


def decode_refused(e: BaseException | None) -> str | None:
    """The decode replica that refused an import as overloaded (``DecodeRefused``, or what wraps it),
    else None."""
    for _ in range(5):
        if e is None:
            return None
        if getattr(e, "code", None) == "overloaded" and isinstance(
            rid := getattr(e, "replica_id", None), str
        ):
            return rid
        e = getattr(e, "cause", None) or e.__cause__
    return None


def transfer_failed(e: BaseException | None) -> bool:
    """``e`` (or what it wraps: Ray's ``cause``, ``__cause__``) is a failed KV transfer."""
    for _ in range(5):
        if e is None:
            return False
        if getattr(e, "code", None) == "kv_transfer_failed":
            return True
        e = getattr(e, "cause", None) or e.__cause__
    return False


class PDClient(LLMClient):
    """Per ingress replica and E/P/D model: ``submit`` and ``outputs`` as ``LLMClient``'s, over two pools."""

    def __init__(
        self,
        prefill: PrefillPool,
        decode: LLMPool,
        prefill_links: PoolLinks | None = None,
        decode_links: PoolLinks | None = None,
        reroute_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(decode, links=decode_links, reroute_timeout_s=reroute_timeout_s)
        self.prefill_pool = prefill
        self.prefill_links = prefill_links
        self._answered: dict[str, RequestOutput] = {}  # ended by their first token: no decode
        self.prefilled_again = 0
        self.decode_refusals = 0  # imports a decode replica refused as overloaded, sent to another
        self.abandoned = 0  # hand-offs no decode replica took, whose pins the prefill replica freed at once
        self._prefill_replicas: dict[str, None] = {}  # every prefill replica that answered this client

    async def submit(self, spec: LLMRequestSpec) -> SubmitReply:
        for attempt in (1, 2):
            handoff = await self._prefill(spec)
            self._prefill_replicas[handoff.replica_id] = None
            if len(self._prefill_replicas) > MAX_REPLICAS_LISTED:  # replicas churn: forget the oldest
                del self._prefill_replicas[next(iter(self._prefill_replicas))]
            if not handoff.handed_off:
                self._answered[spec.request_id] = handoff.first
                return SubmitReply(handoff.replica_id, "")
            try:
                return await self._submit_decode(spec, handoff)
            except BaseException as e:
                # no decode replica took it (refused, failed, or the client left): the prefill replica
                # lets its pin go now, not at its deadline (an early one still prefilling is aborted)
                abandon = self._abandon(handoff)
                if isinstance(e, asyncio.CancelledError):
                    self._background(abandon)
                else:
                    await abandon
                if attempt == 2 or not transfer_failed(e):
                    raise
                logger.warning("KV transfer of %s failed (%r); prefilling it again", spec.request_id, e)
                self.prefilled_again += 1
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def _submit_decode(self, spec: LLMRequestSpec, handoff: KVHandoff) -> SubmitReply:
        """The spec with its hand-off to a decode replica; one that refuses it as overloaded (short of
        blocks, window blocks or a state slot: it allocated nothing, the pin stands) is named in
        ``refused_by`` and another asked, up to ``MAX_DECODE_TRIES`` replicas within half the pin's
        deadline, backing off while every one refuses; then the 503 ``overloaded`` (retryable) stands."""
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + handoff.deadline_s / 2
        for tries in range(1, MAX_DECODE_TRIES + 1):
            try:
                return await super().submit(replace(spec, handoff=handoff))
            except BaseException as e:
                refuser = decode_refused(e)
                if refuser is None or tries == MAX_DECODE_TRIES or loop.time() > give_up_at:
                    raise
                logger.info("decode replica %s refused %s (%s); trying another", refuser, spec.request_id, e)
                self.decode_refusals += 1
                again = refuser in handoff.refused_by  # the router had none left that had not refused
                handoff = replace(
                    handoff, refused_by=(*[r for r in handoff.refused_by if r != refuser], refuser)
                )
                if again:
                    await asyncio.sleep(min(0.05 * 2**tries, 0.5))
        raise AssertionError("unreachable: the last try returns or raises")

    async def _abandon(self, handoff: KVHandoff) -> None:
        """Tell the prefill replica holding ``handoff`` that no decode replica will pull it (its
        ``abort``: the pin freed at once, an early hand-off's prefill stopped); a gone replica has
        nothing left to free."""
        target = ReplicaTarget(handoff.replica_id, request_ids=(handoff.request_id,))
        try:
            link = self.prefill_links.link(handoff.replica_id) if self.prefill_links is not None else None
            if link is not None:
                await asyncio.wait_for(link.call("abort", target), self.connect_timeout_s)
            else:
                await asyncio.wait_for(self.prefill_pool.abort.remote(target), self.connect_timeout_s)
            self.abandoned += 1
        except Exception:
            logger.debug(
                "abandoning %s's hand-off on %s failed", handoff.request_id, handoff.replica_id, exc_info=True
            )

    async def replica_stats(self, timeout_s: float = 5.0) -> dict[str, dict[str, object]]:
        """The decode replicas' counters (``LLMClient``'s), then each prefill replica's that answered."""
        out = await super().replica_stats(timeout_s)
        ids = sorted(self._prefill_replicas)
        calls = (
            counters_or_error(self.prefill_pool.stats.remote(ReplicaTarget(rid)), timeout_s) for rid in ids
        )
        out.update(zip(ids, await asyncio.gather(*calls), strict=True))
        return out

    async def outputs(self, request_id: str, reply: SubmitReply) -> AsyncGenerator[RequestOutput, None]:
        first = self._answered.pop(request_id, None)
        if first is not None:
            yield first
            return
        async for out in super().outputs(request_id, reply):
            yield out

    async def _reroute(self, request_id: str, old: SubmitReply) -> SubmitReply | None:
        """A decode replica lost before the request's first output: prefilled again (the prefill
        replica let its pin go after the first pull), then sent to another decode replica."""
        spec = self._specs.get(request_id)
        if spec is not None and spec.handoff is not None:
            handoff = await self._prefill(replace(spec, handoff=None))
            if not handoff.handed_off:  # sampled differently this time, and ended: nothing to decode
                return None
            self._specs[request_id] = replace(spec, handoff=handoff)
            self.prefilled_again += 1
        return await super()._reroute(request_id, old)

    async def _prefill(self, spec: LLMRequestSpec) -> KVHandoff:
        """``prefill`` on a prefill replica, called again while the replica it reached turns out dead."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.reroute_timeout_s
        attempt = 0
        while True:
            try:
                picked = self.prefill_links.pick(spec) if self.prefill_links and not attempt else None
                if picked is None:
                    handoff: KVHandoff = await self.prefill_pool.prefill.remote(spec)
                    return handoff
                uid, link = picked
                self.prefill_links.routed(spec.request_id, uid, spec)  # type: ignore[union-attr]
                try:
                    handoff = await link.call("prefill", spec)
                    return handoff
                finally:
                    self.prefill_links.done(spec.request_id)  # type: ignore[union-attr]
            except BaseException as e:
                attempt += 1
                if not replica_gone(e) or loop.time() > deadline:
                    raise
                logger.warning(
                    "prefill replica lost before %s's first token (%r); prefilling again", spec.request_id, e
                )
                self.prefilled_again += 1
                await asyncio.sleep(min(0.1 * attempt, 1.0))
