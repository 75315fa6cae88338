"""The encoder pool's Ray Serve replica, ``EncoderServer``, which also prepares its media requests.

    ingress ──prepare──▶ EncoderServer replica: fetch, decode, hash, look up and reserve, process the
                         misses, queue them on its own FIFO (shared with every request it serves),
                         commit ──▶ prompt ids + refs back

One Serve hop fewer per media request than a separate preprocessor pool (removed 12-04): the
pixels never cross a process, the embeddings' refs go straight from their owner to the ingress, and
one Ray worker fewer runs. This is how vLLM's encoder-only instances work (the processor runs where the
vision tower does). The price: preprocessing shares the encoder replica's CPUs and scales with the
encoder pool: give the encoder nodes the CPUs for it.

Ray lives here; the logic they wrap (processing, runner, batching, cache books) does not import it.

EncoderServer keeps a FIFO of items from every request it is sent and runs them in encoder steps
under ``max_num_encoder_input_tokens`` (``serve/encoder_steps.py``); its queue, in embeddings, is what
the encoder pool's request router balances on and what its autoscaling policy scales on.

The replica owns every embedding it puts (Ray has no ``ray.put(_owner=...)``), so its objects die
with it: ``OwnedEmbeddings`` keeps them alive while the shared cache index serves them and, on
graceful shutdown (Serve calls ``__del__``: scale-down, redeploy, ``serve.shutdown``), invalidates
their index entries so the index stops handing out refs that are about to be lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from encoder_service.cache.cache_index import ref_id
from encoder_service.encode.recent_values import value_key
from encoder_service.heap_trim import HeapTrimmer, start_heap_trimmer
from encoder_service.preprocess import tracing
from encoder_service.preprocess.gathering import gather
from encoder_service.preprocess.make_preparer import make_preparer, preparer_stats
from encoder_service.preprocess.prepared import LookedUp, PreparedRequest, with_values
from encoder_service.serve.encoder_steps import DRAIN_TIMEOUT_S, EncoderSteps, stored_form
from encoder_service.serve.metrics import EncoderMetrics, media_stages
from encoder_service.types import EncodeBatch, EncodedItem
from mmcore.feature import MediaFeature

if TYPE_CHECKING:
    from encoder_service.cache.cache_client import EncoderCacheClient
    from encoder_service.encode.runner import TPMode
    from encoder_service.preprocess.media import MediaLimits
    from encoder_service.preprocess.media_items import Message
    from encoder_service.preprocess.prepare import RequestPreparer

__all__ = ["EncoderServer", "stored_form"]  # stored_form: where its readers have always found it


class EncoderServer:
    """One replica = one TP group (leader here, ``mm_encoder_tp_size - 1`` worker actors). With
    ``limits`` (and the shared cache) it prepares requests too (``prepare``, ``prepare_stream``);
    without, it only encodes (the unit tests' encoder)."""

    def __init__(
        self,
        model_dir: str,
        *,
        tp_size: int = 1,
        tp_mode: TPMode = "weights",
        dtype: str = "float32",
        device: str = "auto",
        max_num_encoder_input_tokens: int = 8192,
        num_cpus_per_rank: float = 0.1,
        num_gpus_per_rank: float = 0.0,
        resources_per_rank: dict[str, float] | None = None,
        model_name: str = "",
        cache: EncoderCacheClient | None = None,
        max_queued_embeddings: int | None = None,
        step_embeds: int | None = None,
        torch_threads: int | None = None,
        limits: MediaLimits | None = None,
        limit_mm_per_prompt: dict[str, int] | None = None,
        processor_cache_bytes: int = 0,
        chat_template: str | None = None,
    ) -> None:
        if torch_threads is not None and tp_size == 1:  # the tower's forward runs in this process
            import torch

            torch.set_num_threads(torch_threads)
        self._cache = cache  # EncoderCacheClient: the steps commit to it; invalidated on shutdown
        self.max_num_encoder_input_tokens = max_num_encoder_input_tokens
        self.model_name = model_name
        self._metrics = EncoderMetrics(model_name)
        self._steps = EncoderSteps(
            model_dir,
            tp_size=tp_size,
            tp_mode=tp_mode,
            dtype=dtype,
            device=device,
            max_num_encoder_input_tokens=max_num_encoder_input_tokens,
            num_cpus_per_rank=num_cpus_per_rank,
            num_gpus_per_rank=num_gpus_per_rank,
            resources_per_rank=resources_per_rank,
            cache=cache,
            max_queued_embeddings=max_queued_embeddings,
            step_embeds=step_embeds,
            metrics=self._metrics,
        )
        self.hidden_size = self._steps.hidden_size
        self.row_units = self._steps.row_units  # what the cache charges per embedding
        self.preparer: RequestPreparer | None = None
        self._heap_trimmer: HeapTrimmer | None = None
        if limits is not None:
            self.preparer = self._make_preparer(
                model_dir, limits, limit_mm_per_prompt or {}, processor_cache_bytes, chat_template
            )
            self._heap_trimmer = start_heap_trimmer()  # the preparing threads' freed buffers (heap_trim.py)

    def _make_preparer(
        self,
        model_dir: str,
        limits: MediaLimits,
        limit_mm_per_prompt: dict[str, int],
        processor_cache_bytes: int,
        chat_template: str | None = None,
    ) -> RequestPreparer:
        if self._cache is None:
            raise ValueError("an encoder replica that prepares needs the shared cache index (cache=)")
        return make_preparer(
            model_dir,
            limits=limits,
            limit_mm_per_prompt=limit_mm_per_prompt,
            processor_cache_bytes=processor_cache_bytes,
            chat_template=chat_template,
            cache=self._cache,
            encode=self.encode,  # this replica's own FIFO: no hop, batched with every other request's items
            encode_each=self.submit_apart,  # one step per item: each reaches the LLM when encoded
            model_name=self.model_name,
            stages=media_stages(self.model_name, "encoder"),
        )

    def _preparing(self) -> RequestPreparer:
        if self.preparer is None:
            raise RuntimeError("this encoder replica prepares nothing: it was made without limits=")
        return self.preparer

    @property
    def _queued_embeds(self) -> int:
        return self._steps.queued_embeds

    async def encode(self, batch: EncodeBatch) -> list[EncodedItem]:
        """Embed ``batch.inputs``, commit each to the shared cache under ``batch.request_id``'s
        reservation, and return their metadata and refs, in order."""
        return await gather(*self.submit(batch))

    def submit(self, batch: EncodeBatch, *, apart: bool = False) -> list[asyncio.Future[EncodedItem]]:
        """``encode``, one future per input, each done when its own step is (``EncoderSteps.submit``).
        ``apart``: the items go one step each (a request handed on item by item: overlap prefill)."""
        return self._steps.submit(batch, apart=apart)

    def submit_apart(self, batch: EncodeBatch) -> list[asyncio.Future[EncodedItem]]:
        """``submit`` of a request whose items are handed on as each is encoded (``prepare_stream``)."""
        return self.submit(batch, apart=True)

    async def invalidate_owned(self) -> int:
        """Drop the cache entries that hold this replica's objects; the number dropped. Never raises."""
        return await self._steps.owned.invalidate_all()

    async def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
        """Wait until every queued item is computed and committed (``EncoderSteps.drain``)."""
        return await self._steps.drain(timeout_s)

    async def _shutdown(self) -> int:
        await self.drain()
        if self._heap_trimmer is not None:
            self._heap_trimmer.stop()
        if self._cache is None or not len(self._steps.owned):
            return 0
        return await self.invalidate_owned()

    def __del__(self) -> Awaitable[int] | None:
        """Serve's graceful-shutdown hook: it awaits the coroutine returned here on the replica's loop:
        finish the FIFO (scale-down, redeploy, ``serve.shutdown``), then drop the entries we own.

        A plain ``def`` on purpose: the garbage collector also calls ``__del__``, where a coroutine
        would only warn. Outside a running event loop (GC, interpreter exit) it does nothing.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return None
        if getattr(self, "_steps", None) is None:
            return None
        return self._shutdown()

    def record_routing_stats(self) -> dict[str, float]:
        # reported_at: router.routing.inflight.REPORTED_AT (the router subtracts its own calls then)
        return {"queued_embeddings": self._queued_embeds, "reported_at": time.time()}

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {"queued_embeddings": float(self._queued_embeds)}

    def stats(self) -> dict[str, object]:
        return {
            "queued_embeddings": self._queued_embeds,
            "queued_items": self._steps.queued_items,
            "owned_embeddings": len(self._steps.owned),  # refs this replica keeps alive for the index
            "replica_id": _replica_id(),
            "inline_values_sent": self._steps.recent.taken,
            **self._steps.step_clock.stats(),
            **(preparer_stats(self.preparer) if self.preparer is not None else {}),
        }

    def recent_value(self, ref: object, part: int | None = None) -> object | None:
        """The stored form of an item this replica put lately, if small (``RecentValues``)."""
        return self._steps.recent.get(value_key(ref_id(ref), part))

    def check_health(self) -> None:
        self._steps.check_health()

    async def prepare(
        self,
        request_id: str,
        messages: Sequence[Message],
        looked_up: LookedUp | None = None,
        trace_headers: dict[str, str] | None = None,
    ) -> PreparedRequest:
        """The router's one call per media request (encoder_service/preprocess/prepare.py). Items
        whose embeddings this replica put lately carry them inline when small (``RecentValues``):
        the LLM replica then takes them instead of fetching them. ``trace_headers``: the caller's
        trace context, for a sampled request (encoder_service/preprocess/tracing.py)."""
        with tracing.remote_span("encoder.prepare", trace_headers, request_id) as span:
            prepared = await self._preparing().prepare(request_id, messages, looked_up)
            if span is not None:
                span.set_attribute(tracing.MM_HASHES, [it.mm_hash for it in prepared.items])
        return with_values(prepared, self.recent_value)

    async def prepare_stream(
        self,
        request_id: str,
        messages: Sequence[Message],
        looked_up: LookedUp | None = None,
        trace_headers: dict[str, str] | None = None,
    ) -> AsyncIterator[PreparedRequest | list[MediaFeature]]:
        """``prepare`` handed on item by item (``RequestPreparer.prepare_stream``): the prompt and its
        items first, the ones still encoding without a ref; then each item as its step ends. The
        ingress submits to the LLM on the first frame and forwards the rest (encoding overlaps the
        prefill of everything before the first item still missing)."""
        with tracing.remote_span("encoder.prepare", trace_headers, request_id) as span:
            frames = self._preparing().prepare_stream(request_id, messages, looked_up)
            async with contextlib.aclosing(frames):
                async for frame in frames:
                    if isinstance(frame, PreparedRequest):
                        if span is not None:
                            span.set_attribute(tracing.MM_HASHES, [it.mm_hash for it in frame.items])
                        yield with_values(frame, self.recent_value)
                    else:
                        yield [replace(it, value=self.recent_value(it.ref[0], it.part)) for it in frame]


def _replica_id() -> str:
    """Serve's id of this replica (the tail of its actor's name), for readers that must tell replicas
    apart (the chaos bench kills the one with items queued); "" outside Serve."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside Serve (tests)
        return ""
