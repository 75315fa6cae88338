"""The LLM pool's Ray Serve replica: one engine, its step loop, and output channels to the ingresses.

A request arrives with ``submit`` (a short unary call: embeddings fetched, request queued); its
tokens leave on the calling ingress's output channel (``channel``: one long-lived stream per
ingress, one message per engine step — see output_channels.py); ``abort`` stops requests whose
client left. Ray lives here and nowhere else in llm_service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from llm_service.config import EngineConfig
from llm_service.embeddings import resolve_embeddings, unfetched
from llm_service.engine_loop import EngineLoop, SteppedEngine
from llm_service.errors import RequestFailed, RequestRejected
from llm_service.kv_handoff import KVBlocks, KVHandoff, KVTransferFailed
from llm_service.output_channels import ChannelBatch, OutputChannels
from llm_service.outputs import EngineStats, RequestOutput
from llm_service.recent_ttft import RecentTTFT
from llm_service.request_spec import LLMRequestSpec, ReplicaTarget, SubmitReply
from llm_service.scheduler import WaitingBound
from llm_service.sequence import Request
from llm_service.serve.handoff import Address, DecodeImports, KVSource, PrefillHandoffs, TransferStats
from llm_service.serve.kv_pair import DecodePairs, PairOffer, SendAsk, SendPlan
from llm_service.serve.metrics import LLMMetrics
from llm_service.tracing import RequestTraces
from mmcore.errors import StillHeld
from mmcore.feature import MediaFeature

if TYPE_CHECKING:
    from ray import ObjectRef

    from llm_service.engine import LLMEngine

logger = logging.getLogger("mmserve.llm")


def _replica_id() -> str:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside Serve (tests): any unique name will do
        return f"local-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class HandoffWiring:
    """What an E/P/D replica takes from the wiring: where its own link listens (a prefill replica's
    answer names it), a link to a prefill replica (a decode replica pulls over it), the deadlines."""

    address: Callable[[], Awaitable[Address]]
    connect: Callable[[Address], KVSource]
    deadline_s: float = 30.0  # a prefill replica holds a hand-off's blocks this long for its pull
    timeout_s: float = 10.0  # a decode replica's pull fails past this
    pull_chunks: bool = False  # a prefill replica answers at once; the decode side pulls chunk by chunk
    transfer: str = "link"  # "collective": the KV moves on a pair group (llm_service/serve/kv_pair.py)


class LLMServer:
    """Serve replica body (wrapped by ``serve.deployment`` in cluster/app.py)."""

    def __init__(
        self,
        engine_config: EngineConfig,
        model_name: str,
        engine_cls: Callable[[EngineConfig], SteppedEngine] | None = None,
        embedding_fetch_timeout_s: float = 60.0,
        channel_linger_s: float = 5.0,
        max_waiting_requests: int | None = None,
        max_waiting_tokens: int | None = None,
        role: str = "both",
        handoff: HandoffWiring | None = None,
    ) -> None:
        if engine_cls is None:
            from llm_service.engine import LLMEngine

            engine_cls = LLMEngine
        self.model_name = model_name
        self.replica_id = _replica_id()
        self.engine = engine_cls(engine_config)
        self._metrics = LLMMetrics(model_name)
        self._ttft = RecentTTFT()  # the prefill pool's autoscaling signal (with a target_ttft_ms)
        self.channels = OutputChannels(self.replica_id, self._abort_all, linger_s=channel_linger_s)
        self.loop = EngineLoop(
            self.engine,
            on_outputs=self._on_outputs,
            on_error=self.channels.fail,
            waiting_bound=WaitingBound(max_waiting_requests, max_waiting_tokens),
            on_parked=self._on_parked,
        )
        self.embedding_fetch_timeout_s = embedding_fetch_timeout_s
        self._unfetched: dict[str, list[MediaFeature]] = {}  # request id -> items sent without rows
        # request id -> offset -> its items still being encoded, until they arrive (``arrived``);
        # kept, empty, until the request ends
        self._arriving: dict[str, dict[int, MediaFeature]] = {}
        self._supplies: set[asyncio.Task[None]] = set()
        self.skipped_fetches = 0  # items whose embeddings were never fetched (prefix cache)
        self._traces = RequestTraces()  # sampled requests' trace contexts (llm_service/tracing.py)
        # E/P/D (llm_service/serve/handoff.py): a prefill replica's pins, a decode replica's imports
        self.role = role
        self.kv_stats = TransferStats()
        self._prefill: PrefillHandoffs | None = None
        self._decode: DecodeImports | None = None
        self.kv_pull_chunks = handoff is not None and handoff.pull_chunks
        if role != "both":
            if handoff is None:
                raise ValueError(f"an LLM replica of role {role!r} needs its hand-off wiring")
            engine = cast("LLMEngine", self.engine)
            if role == "prefill":
                self._prefill = PrefillHandoffs(
                    self.loop, engine, self.replica_id, handoff.address, handoff.deadline_s, self.kv_stats
                )
            else:
                pairs = None
                if handoff.transfer == "collective":
                    pairs = DecodePairs(
                        engine, handoff.address, handoff.timeout_s, self.kv_stats, self.replica_id
                    )
                self._decode = DecodeImports(
                    self.loop,
                    engine,
                    handoff.connect,
                    handoff.timeout_s,
                    self.kv_stats,
                    self.replica_id,
                    pairs,
                )

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        if self._prefill is not None:
            self._prefill.on_outputs(outputs)
        self.channels.deliver(outputs)
        self._ttft.observe(outputs)
        self._metrics.observe_step(outputs, self.loop.last_step_s, self.loop.step_clock.last_cpu_s)
        if self._traces:  # sampled requests in flight: their spans, once done
            for out in outputs:
                if out.timing is not None:
                    self._traces.finish(out)

    def _abort_all(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.loop.abort(rid)

    async def submit(self, spec: LLMRequestSpec) -> AsyncIterator[SubmitReply]:
        """Fetch the request's embeddings and queue it; yield where its outputs go (``spec.ingress_id``'s
        channel), then stay open until it is done. Cancelled before that (its client left): aborted.

        Raises ``EmbeddingsLost`` (before the engine sees the request) if an embedding cannot be
        fetched: its encoder replica died, or the fetch took longer than the timeout (an item not
        fetched here, its span prefix-cached, that is lost when a parked request fetches it: the
        same error on the request's channel, before any output); and
        ``WaitingQueueFull`` at once, before any fetch, if the engine's waiting queue is at its bound.
        """
        reply, later = await self._enqueue(spec)
        rid = spec.request_id
        done = self.channels.done(rid)
        try:
            yield reply
            await done
        finally:
            self._forget_unfetched(rid, later)
            if not done.done():  # the caller went away: stop generating, free its KV blocks
                self.channels.forget(rid)
                self.loop.abort(rid)

    async def submit_detached(self, spec: LLMRequestSpec) -> SubmitReply:
        """``submit`` for a request whose life its ingress's output channel holds, not this call
        (a call over a direct link: cluster/replica_links.py): answers once queued.
        It ends with its last output, an ``abort`` from its ingress, or the channel's reader going
        away (orphaned: aborted). Raises what ``submit`` raises, before queueing anything."""
        reply, later = await self._enqueue(spec)
        if later:
            rid = spec.request_id
            self.channels.done(rid).add_done_callback(lambda _: self._forget_unfetched(rid, later))
        return reply

    async def prefill(self, spec: LLMRequestSpec) -> KVHandoff:
        """A prefill replica's call: compute the prompt and its first token; answer where its KV waits
        (``KVHandoff``), or the first output alone when it ended the request. Its items' embeddings
        are fetched here (never on the decode side); cancelled before the answer: aborted."""
        if self._prefill is None:
            raise RequestRejected("bad_role", f"replica {self.replica_id} is not a prefill replica")
        if self.loop.holds(spec.request_id):
            raise StillHeld(f"replica {self.replica_id} still runs an earlier attempt of {spec.request_id!r}")
        self.loop.check_capacity(len(spec.prompt_token_ids))
        structured = spec.sampling_params.structured
        if structured is not None and (prepare := getattr(self.engine, "prepare_structured", None)):
            await prepare(structured)
        if any(it.pending for it in spec.mm_items):
            raise RequestRejected("bad_role", "a prefill replica takes no items still being encoded")
        mm_inputs = await resolve_embeddings(list(spec.mm_items), self._fetch) if spec.mm_items else []
        params = spec.sampling_params
        outs = self.loop.stream(
            spec.request_id, list(spec.prompt_token_ids), params, mm_inputs, spec.cache_salt, handoff=True
        )
        if self.kv_pull_chunks:  # answered at once: the decode replica pulls as the chunks compute
            return await self._prefill.early.answer(spec, outs)
        async with contextlib.aclosing(outs):  # type: ignore[type-var]
            async for first in outs:
                if first.finish_reason == "error":
                    raise RequestFailed(spec.request_id, first.error or "unknown error")
                return await self._prefill.handoff(spec, first)
        raise RuntimeError(f"{spec.request_id} ended without an output")

    async def pull_kv(self, request_id: str, from_block: int, window_from: int = 0) -> KVBlocks:
        """A decode replica's pull of a handed-off request's blocks (over the direct link)."""
        if self._prefill is None:
            raise KVTransferFailed(f"replica {self.replica_id} is not a prefill replica")
        return await self._prefill.pull(request_id, from_block, window_from)

    async def pull_kv_chunks(
        self, request_id: str, from_block: int, window_from: int = 0
    ) -> tuple[KVBlocks | None, bool]:
        """A decode replica's pull of an early hand-off's blocks computed so far, the rest once the
        prefill is done (llm_service/serve/early_handoff.py)."""
        if self._prefill is None:
            raise KVTransferFailed(f"replica {self.replica_id} is not a prefill replica")
        return await self._prefill.early.pull_chunks(request_id, from_block, window_from)

    async def kv_pair_join(self, offer: PairOffer) -> None:
        """A decode replica's invitation to form its pair group with this prefill replica (kv_pair.py)."""
        if self._prefill is None:
            raise KVTransferFailed(f"replica {self.replica_id} is not a prefill replica")
        await self._prefill.pairs.join(offer)

    async def kv_send(self, ask: SendAsk) -> SendPlan:
        """A decode replica's ask for a handed-off request's KV on their pair group: answered with what
        will be sent, then sent (llm_service/serve/kv_pair.py)."""
        if self._prefill is None:
            raise KVTransferFailed(f"replica {self.replica_id} is not a prefill replica")
        return await self._prefill.pairs.send(ask)

    async def _enqueue(self, spec: LLMRequestSpec) -> tuple[SubmitReply, list[MediaFeature]]:
        """Fetch what must be fetched, put the request on its ingress's channel and in the engine's
        queue; returns where its outputs go and the items sent without their embeddings. A decode
        replica imports the request's KV instead (``spec.handoff``), fetching nothing."""
        if self.loop.holds(spec.request_id):  # nothing of the earlier attempt is touched
            raise StillHeld(f"replica {self.replica_id} still runs an earlier attempt of {spec.request_id!r}")
        if self._decode is not None or spec.handoff is not None:
            return await self._import(spec), []
        if self._prefill is not None:
            raise RequestRejected("bad_role", f"replica {self.replica_id} is a prefill replica: call prefill")
        self.loop.check_capacity(len(spec.prompt_token_ids))
        structured = spec.sampling_params.structured
        if structured is not None and (prepare := getattr(self.engine, "prepare_structured", None)):
            await prepare(structured)  # compiled off the loop and the step; a bad grammar is a 400 here
        if spec.trace_headers:
            self._traces.start(spec.request_id, spec.trace_headers, [m.mm_hash for m in spec.mm_items])
        # Items whose whole span the prefix cache holds are not fetched: those positions are never
        # computed. If their blocks are evicted before the request is admitted, the engine parks
        # it and ``_on_parked`` fetches them then.
        # Items still being encoded (no ref yet) arrive later (``arrived``): the engine computes up to
        # the first of them meanwhile.
        arriving = [it for it in spec.mm_items if it.pending]
        present = [it for it in spec.mm_items if not it.pending]
        cached = self._cached_prefix_tokens(spec) if present else 0
        later = [it for it in present if it.offset + it.length <= cached]
        now = [it for it in present if it.offset + it.length > cached]
        mm_inputs = await resolve_embeddings(now, self._fetch) if now else []
        mm_inputs += unfetched(later) + unfetched(arriving)
        rid = spec.request_id
        if arriving:  # before submit: an arrival may come as soon as the reply has gone
            self._arriving[rid] = {it.offset: it for it in arriving}
        channel_id = self.channels.register(spec.ingress_id, rid)
        try:
            self.loop.submit(
                rid, list(spec.prompt_token_ids), spec.sampling_params, mm_inputs, cache_salt=spec.cache_salt
            )
        except BaseException:
            self._arriving.pop(rid, None)
            self.channels.forget(rid)
            self.loop.abort(rid)
            raise
        if arriving:
            self.channels.done(rid).add_done_callback(lambda _: self._arriving.pop(rid, None))
        if later:  # set after submit (a duplicate id raised there), before any step can park it
            self._unfetched[rid] = later
            self.skipped_fetches += len(later)
        return SubmitReply(self.replica_id, channel_id), later

    async def _import(self, spec: LLMRequestSpec) -> SubmitReply:
        if self._decode is None or spec.handoff is None or not spec.handoff.handed_off:
            raise RequestRejected(
                "bad_role", f"replica {self.replica_id} ({self.role}) takes no such request"
            )
        rid = spec.request_id
        channel_id = self.channels.register(spec.ingress_id, rid)
        try:
            await self._decode.import_request(spec)
        except BaseException:
            self.channels.forget(rid)
            raise
        if not self.channels.holds(rid):  # orphaned during the pull: its abort found nothing to stop
            self.loop.abort(rid)
        return SubmitReply(self.replica_id, channel_id)

    def _forget_unfetched(self, request_id: str, later: list[MediaFeature]) -> None:
        if later and self._unfetched.get(request_id) is later:
            del self._unfetched[request_id]

    async def _fetch(self, ref: ObjectRef) -> object:
        async with asyncio.timeout(self.embedding_fetch_timeout_s):  # no task, unlike wait_for
            return await ref

    def _cached_prefix_tokens(self, spec: LLMRequestSpec) -> int:
        """How many leading prompt tokens the engine's prefix cache holds for ``spec`` now. Read on
        the event loop while a step may run on the engine thread, so only a hint: the scheduler
        checks again when it admits the request, and parks it if an unfetched item fell out."""
        kv = getattr(self.engine, "kv", None)
        if kv is None or not spec.mm_items:
            return 0
        try:
            probe = Request(
                spec.request_id,
                list(spec.prompt_token_ids),
                spec.sampling_params,
                mm_spans=sorted((m.offset, m.length, m.mm_hash) for m in spec.mm_items),
                cache_salt=spec.cache_salt,
            )
            # The router hashed the same blocks for its prefix affinity: reused when they are this
            # engine's blocks (a lookup checks each block's tokens and keys too, so a wrong hash
            # can only miss).
            if len(spec.block_hashes) == len(spec.prompt_token_ids) // int(kv.block_size):
                probe.block_hashes = [bytes(h) for h in spec.block_hashes]
            return len(kv.get_computed_blocks(probe)) * int(kv.block_size)
        except Exception:  # a block changed under the read: fetch everything
            logger.debug("prefix probe of %s failed", spec.request_id, exc_info=True)
            return 0

    def _on_parked(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if rid in self._arriving and rid not in self._unfetched:  # its items are on their way
                continue
            task = asyncio.get_running_loop().create_task(self._supply(rid))
            self._supplies.add(task)
            task.add_done_callback(self._supplies.discard)

    async def _supply(self, request_id: str) -> None:
        """Fetch what a parked request was sent without, and hand it to the engine; a loss fails it."""
        items = self._unfetched.get(request_id)
        if not items:  # nothing to fetch for it: it would wait forever
            self.loop.abort(request_id)
            self.channels.fail(request_id, RuntimeError(f"{request_id} was parked with nothing to fetch"))
            return

        try:
            mm_inputs = await resolve_embeddings(items, self._fetch)
        except Exception as e:
            logger.warning("embeddings of parked request %s could not be fetched: %r", request_id, e)
            self.loop.abort(request_id)
            self.channels.fail(request_id, e)
            return
        self.skipped_fetches -= len(items)  # fetched after all
        self.loop.supply(request_id, mm_inputs)

    async def arrived(
        self, target: ReplicaTarget, items: list[MediaFeature], error: BaseException | None = None
    ) -> None:
        """Items of ``target.request_ids[0]`` that were still encoding when it was submitted, now
        committed: fetched and handed to the engine, which goes on up to the next item it lacks.
        ``error``: its encoding failed; the request fails with it (its KV blocks freed). An item
        that cannot be fetched fails it with ``EmbeddingsLost`` (the ingress encodes it again).
        Unknown requests (finished, aborted) are ignored."""
        rid = target.request_ids[0]
        waiting = self._arriving.get(rid)
        if waiting is None:
            return
        if error is None:
            unknown = [it for it in items if waiting.get(it.offset) is None or it.pending]
            if unknown:
                error = ValueError(
                    f"{rid}: no item still to come at offset(s) {[it.offset for it in unknown]}"
                )
        if error is None:
            for it in items:  # (its entry stays, empty, until it ends: a report may still come)
                del waiting[it.offset]
            try:
                mm_inputs = await resolve_embeddings(items, self._fetch)
            except Exception as e:
                error = e
            else:
                self.loop.supply(rid, mm_inputs)
                return
        logger.warning("request %s failed while its items were encoding: %r", rid, error)
        self._arriving.pop(rid, None)
        self.loop.abort(rid)
        self.channels.fail(rid, error)

    async def channel(self, target: ReplicaTarget) -> AsyncIterator[ChannelBatch]:
        """Stream one output channel (``submit`` named it); it ends when the channel closes."""
        async for batch in self.channels.stream(target.channel_id):
            yield batch

    async def abort(self, target: ReplicaTarget) -> None:
        """Stop the requests; on a prefill replica, also give up their hand-offs (pins freed now)."""
        for rid in target.request_ids:
            self.channels.forget(rid)
            self.loop.abort(rid)
            if self._prefill is not None:
                await self._prefill.abandon(rid)

    def _swap_counters(self) -> dict[str, float]:
        """A decode replica's swap space (llm_service/kv_swap.py): swaps so far, host bytes held
        now, its budget, and the requests ended because their copy would have passed it."""
        assert self._decode is not None
        swap = self._decode.engine.swap
        return {
            "kv_swapped_out": swap.swapped_out,
            "kv_swap_bytes": swap.held_bytes,
            "kv_swap_budget_bytes": swap.budget_bytes or 0,
            "kv_swap_refused": swap.refused,
        }

    def _pair_counts(self) -> dict[str, int]:
        """Pair groups held now (``llm.kv_transfer: collective``), either side."""
        if self._prefill is not None:
            return {"kv_pairs": len(self._prefill.pairs)}
        if self._decode is not None and self._decode.pairs is not None:
            return {"kv_pairs": len(self._decode.pairs)}
        return {}

    def _engine_stats(self) -> EngineStats:
        return self.loop.last_stats or self.engine.stats()

    def stats(self, target: ReplicaTarget | None = None) -> dict[str, object]:
        """Engine counters; ``target`` (a ``ReplicaTarget``) routes the call to one replica."""
        s = self._engine_stats()
        return {
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_free_blocks": s.num_free_blocks,
            "num_total_blocks": s.num_total_blocks,
            "kv_usage": s.kv_usage,
            "prefix_hit_tokens": s.prefix_hit_tokens,
            "skipped_embedding_fetches": self.skipped_fetches,
            "prefix_query_tokens": s.prefix_query_tokens,
            "num_preemptions": s.num_preemptions,
            **_reported_if_any(num_free_window_blocks=s.num_free_window_blocks),
            **_reported_if_any(num_free_state_slots=s.num_free_state_slots),
            "output_channels": len(self.channels),
            "replica_id": self.replica_id,
            "role": self.role,
            **self.loop.step_clock.stats(),
            **(self.kv_stats.as_dict() if self.role != "both" else {}),
            **({"kv_pins_held": len(self._prefill.pins)} if self._prefill is not None else {}),
            **self._pair_counts(),
            **(self._swap_counters() if self._decode is not None else {}),
        }

    def record_routing_stats(self) -> dict[str, object]:
        """Called by Serve's controller; read by router.routing.request_routers.PrefixAffinityRouter."""
        self.channels.drop_unconnected()
        stats = self.stats()
        self._metrics.export(self._engine_stats())
        return {**stats, "reported_at": time.time()}  # router.routing.inflight.REPORTED_AT

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metrics read by cluster.autoscaling_policy.LLMLoadPolicy."""
        s = self._engine_stats()
        return {
            "kv_usage": float(s.kv_usage),
            "num_running": float(s.num_running),
            "num_waiting": float(s.num_waiting),
            "queued_prompt_tokens": float(
                self.loop.queued_prompt_tokens
            ),  # E/P/D's prefill pool scales on it
            "ttft_p90_ms": self._ttft.p90_ms(),  # and on this, given a target_ttft_ms
        }

    def check_health(self) -> None:
        task = self.loop.task
        if task is not None and task.done():
            why = "cancelled" if task.cancelled() else repr(task.exception())
            raise RuntimeError(f"engine loop died: {why}")


def _reported_if_any(**counts: int | None) -> dict[str, int]:
    """The counts the model has (a window group's, a hybrid's state slots), for ``stats``."""
    return {k: v for k, v in counts.items() if v is not None}
