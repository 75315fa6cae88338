"""``PreparingEncoderServer``: the encoder replica, which also prepares its media requests.

    Ingress ──prepare──▶ EncoderPool replica: fetch, decode, hash, look up and reserve, process the
                         misses, queue them on its own FIFO (shared with every request it serves),
                         commit ──▶ prompt ids + refs back

One Serve hop fewer per media request than a separate preprocessor pool (removed 12-04): the
pixels never cross a process, the embeddings' refs go straight from their owner to the ingress, and
one Ray worker fewer runs. This is how vLLM's encoder-only instances work (the processor runs where the
vision tower does). The price: preprocessing shares the encoder replica's CPUs and scales with the
encoder pool: give the encoder nodes the CPUs for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from encoder_service.preprocess import tracing
from encoder_service.preprocess.make_preparer import make_preparer, preparer_stats
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.media_items import Message
from encoder_service.preprocess.prepared import LookedUp, PreparedRequest, with_values
from encoder_service.serve.deployment import EncoderPoolServer
from encoder_service.serve.metrics import media_stages
from mmcore.feature import MediaFeature


class PreparingEncoderServer(EncoderPoolServer):
    def __init__(
        self,
        model_dir: str,
        *,
        limits: MediaLimits,
        limit_mm_per_prompt: dict[str, int],
        processor_cache_bytes: int,
        **encoder: Any,  # Any: EncoderPoolServer's keywords, checked by its signature
    ) -> None:
        super().__init__(model_dir, **encoder)
        if self._cache is None:
            raise ValueError("an encoder replica that prepares needs the shared cache index (cache=)")
        self.preparer = make_preparer(
            model_dir,
            limits=limits,
            limit_mm_per_prompt=limit_mm_per_prompt,
            processor_cache_bytes=processor_cache_bytes,
            cache=self._cache,
            encode=self.encode,  # this replica's own FIFO: no hop, batched with every other request's items
            encode_each=self.submit_apart,  # one step per item: each reaches the LLM when encoded
            model_name=self.model_name,
            stages=media_stages(self.model_name, "encoder"),
        )

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
            prepared = await self.preparer.prepare(request_id, messages, looked_up)
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
            frames = self.preparer.prepare_stream(request_id, messages, looked_up)
            async with contextlib.aclosing(frames):
                async for frame in frames:
                    if isinstance(frame, PreparedRequest):
                        if span is not None:
                            span.set_attribute(tracing.MM_HASHES, [it.mm_hash for it in frame.items])
                        yield with_values(frame, self.recent_value)
                    else:
                        yield [replace(it, value=self.recent_value(it.ref[0], it.part)) for it in frame]

    def stats(self) -> dict[str, object]:
        return {**super().stats(), **preparer_stats(self.preparer)}
