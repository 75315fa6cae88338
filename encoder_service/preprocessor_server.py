"""The CPU pool's Ray Serve replica, ``PreprocessorServer`` (``preprocess.placement: pool``), and the
``RequestPreparer`` every preparing side builds (``make_preparer``: this pool, a preparing encoder
replica, the ingress's hit path).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from encoder_service.prepared import LookedUp, PreparedRequest
from encoder_service.types import EncodeBatch, EncodedItem

logger = logging.getLogger("mmserve.encoder")

ENCODE_ATTEMPTS = 3  # an encoder replica that dies mid-step: its items go to another (or its successor)
_REPLICA_GONE = ("ActorDiedError", "ActorUnavailableError", "RayActorError")


def make_preparer(
    model_dir: str,
    *,
    limits: Any,
    limit_mm_per_prompt: dict[str, int],
    processor_cache_bytes: int,
    cache: Any,
    encode: Any,
    model_name: str = "",
) -> Any:
    """A ``RequestPreparer`` over this model's processor, the shared cache client and ``encode`` (the
    encoder pool's handle, or an encoder replica's own FIFO when it prepares itself)."""
    from encoder_service.prepare import RequestPreparer
    from encoder_service.processing import Preprocessor

    preprocessor = Preprocessor(
        model_dir, limits, limit_mm_per_prompt, processor_cache_bytes, model_id=model_name or None
    )
    preprocessor.aliases = cache  # uuid names live in the cache shards (uuid_aliases.py)
    return RequestPreparer(preprocessor, cache, encode)


def preparer_stats(preparer: Any) -> dict[str, Any]:
    pre = preparer.preprocessor
    return {"processor_calls": pre.num_processor_calls, "processor_cache": pre.processor_cache.stats()}


class PreprocessorServer:
    """CPU pool replica (``preprocess.placement: pool``): fetch, decode, hash, look up, process and
    send the misses to the encoder pool.

    ``prepare`` is the router's one call per media request (encoder_service/prepare.py); the encoder
    pool is called from here, next to the cache, and its outputs come back as refs.
    """

    def __init__(
        self,
        model_dir: str,
        *,
        limits: Any,
        limit_mm_per_prompt: dict[str, int],
        processor_cache_bytes: int,
        cache: Any,
        encoder: Any = None,
        model_name: str = "",
    ) -> None:
        self.cache = cache  # the model's shared encoder cache (cache_client.EncoderCacheClient)
        self.encoder = encoder  # DeploymentHandle of the model's EncoderPool
        self.preparer = make_preparer(
            model_dir,
            limits=limits,
            limit_mm_per_prompt=limit_mm_per_prompt,
            processor_cache_bytes=processor_cache_bytes,
            cache=self.cache,
            encode=self._encode,
            model_name=model_name,
        )
        self.preprocessor = self.preparer.preprocessor

    async def _encode(self, batch: EncodeBatch) -> list[EncodedItem]:
        """Encode on the pool; if the replica dies mid-step, send the batch again (Serve routes it to
        a live replica, or waits for the successor). The reservations are still this request's, so
        the new replica commits them; an item the dead one committed keeps its entry (a later reader
        finds its object lost and re-encodes it)."""
        if self.encoder is None:
            raise RuntimeError("this preprocessor has no encoder pool to send misses to")
        for attempt in range(1, ENCODE_ATTEMPTS + 1):
            try:
                return list(await self.encoder.encode.remote(batch))
            except Exception as e:
                names = {c.__name__ for c in type(e).__mro__}
                if attempt == ENCODE_ATTEMPTS or not names.intersection(_REPLICA_GONE):
                    raise
                logger.warning(
                    "encoder replica lost while encoding %d item(s) of %s (%s); sending them again",
                    len(batch.inputs),
                    batch.request_id,
                    type(e).__name__,
                )
                await asyncio.sleep(0.2 * attempt)
        raise AssertionError("unreachable")

    async def prepare(
        self, request_id: str, messages: list[dict[str, Any]], looked_up: LookedUp | None = None
    ) -> PreparedRequest:
        return await self.preparer.prepare(request_id, messages, looked_up)

    def stats(self) -> dict[str, Any]:
        return preparer_stats(self.preparer)
