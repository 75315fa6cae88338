"""``PreparingEncoderServer``: an encoder replica that also prepares its media requests
(``preprocess.placement: encoder``, what ``mmserve serve`` runs on one machine).

    Ingress ──prepare──▶ EncoderPool replica: fetch, decode, hash, look up and reserve, process the
                         misses, queue them on its own FIFO (shared with every request it serves),
                         commit ──▶ prompt ids + refs back
                         (with a forwarder: submitted to the LLM pool from here, and the reply
                         says where; router/forwarding.py)

One Serve hop fewer per media request than a separate preprocessor pool (``placement: pool``): the
pixels never cross a process, the embeddings' refs go straight from their owner to the ingress, and
one Ray worker fewer runs. This is how vLLM's encoder-only instances work (the processor runs where the
vision tower does). The price: preprocessing shares the encoder replica's CPUs and scales with the
encoder pool, so a cluster whose GPU nodes are short of CPU keeps the separate pool.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

from encoder_service.deployment import EncoderPoolServer
from encoder_service.prepared import LookedUp, PreparedRequest, with_values
from encoder_service.preprocessor_server import make_preparer, preparer_stats


class Forwarder(Protocol):
    """Hands a prepared request on to the LLM pool (router.forwarding.PreparedForwarder). ``how`` is
    the router's own record, opaque here; the answer is (LLM replica id, output channel id), or
    None when the router is to submit it itself."""

    async def forward(self, prepared: PreparedRequest, how: Any) -> tuple[str, str] | None: ...

    def stats(self) -> dict[str, int]: ...


class PreparingEncoderServer(EncoderPoolServer):
    def __init__(
        self,
        model_dir: str,
        *,
        limits: Any,
        limit_mm_per_prompt: dict[str, int],
        processor_cache_bytes: int,
        forwarder: Forwarder | None = None,
        **encoder: Any,
    ) -> None:
        super().__init__(model_dir, **encoder)
        self.forwarder = forwarder
        if self._cache is None:
            raise ValueError("an encoder replica that prepares needs the shared cache index (cache=)")
        self.preparer = make_preparer(
            model_dir,
            limits=limits,
            limit_mm_per_prompt=limit_mm_per_prompt,
            processor_cache_bytes=processor_cache_bytes,
            cache=self._cache,
            encode=self.encode,  # this replica's own FIFO: no hop, batched with every other request's items
            model_name=self.model_name,
        )

    async def prepare(
        self,
        request_id: str,
        messages: list[dict[str, Any]],
        looked_up: LookedUp | None = None,
        forward: Any = None,
    ) -> PreparedRequest:
        """The router's one call per media request (encoder_service/prepare.py); with ``forward``
        (and a forwarder), submitted to the LLM pool from here before the answer goes back. Items
        whose embeddings this replica put lately carry them inline when small (``RecentValues``):
        the LLM replica then takes them instead of fetching them."""
        prepared = with_values(
            await self.preparer.prepare(request_id, messages, looked_up), self.recent_value
        )
        if forward is None or self.forwarder is None:
            return prepared
        return replace(prepared, forwarded_to=await self.forwarder.forward(prepared, forward))

    def stats(self) -> dict[str, Any]:
        forwarding = self.forwarder.stats() if self.forwarder is not None else {}
        return {**super().stats(), **preparer_stats(self.preparer), **forwarding}
