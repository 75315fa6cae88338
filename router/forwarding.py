"""Forwarding: the encoder replica that prepared a media request submits it to the LLM pool itself.

    before:  ingress ─prepare─▶ encoder ─refs─▶ ingress ─submit─▶ LLM ─first token─▶ ingress
    now:     ingress ─prepare─▶ encoder ─submit─▶ LLM ─first token─▶ ingress
                                       └─refs + where it went─▶ ingress   (beside the first token)

The ingress sends a ``ForwardRequest`` with ``prepare`` (its id, the request's sampling params and
cache salt). The replica builds the ``LLMRequestSpec`` the ingress would (``request_spec``: prompt
ids, embedding refs, block hashes) and submits it detached (``LLMServer.submit_detached``): the
request's life is tied to the ingress's output channel, not to a call, so the encoder replica
holds nothing once it has answered (and may scale down). The ingress registered the request's
queue before its call (``LLMClient.expect``), so tokens that arrive before the reply are kept;
with the reply it adopts the request: its spec kept for rerouting, its blocks recorded in this
process's prefix-affinity index (the encoder's router chose the replica).

What the replica cannot forward (a prompt that does not fit ``max_model_len``, a full waiting
queue, lost embeddings, an LLM replica gone) it leaves to the ingress, which submits as before and
answers the error the same way.

The router's module: it runs inside the encoder replica (cluster/app.py hands it in) and knows both
services' records, which the services themselves never import.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from encoder_service.prepared import PreparedRequest
from llm_service.prefix_hash import compute_block_hashes
from llm_service.request_spec import EmbeddingRef, LLMRequestSpec, SubmitReply
from llm_service.sampling_params import SamplingParams
from llm_service.wire import pack, unpack
from router.errors import APIError
from router.sampling import fit_to_prompt

logger = logging.getLogger("mmserve.router")


@dataclass(frozen=True)
class ForwardRequest:
    """What an encoder replica needs, beside the prepared request, to submit it for the ingress."""

    request_id: str
    ingress_id: str
    sampling_params: SamplingParams  # max_tokens fitted to the prompt by the forwarder
    requested_max_tokens: int | None = None  # None: the rest of max_model_len
    cache_salt: str | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        record = {f.name: getattr(self, f.name) for f in fields(self)}
        record["sampling_params"] = self.sampling_params.to_wire()
        return (_forward_from_bytes, (pack("ForwardRequest", record),))


def _forward_from_bytes(raw: bytes) -> ForwardRequest:
    d = unpack("ForwardRequest", raw)
    d["sampling_params"] = SamplingParams.from_wire(d["sampling_params"])
    return ForwardRequest(**{f.name: d[f.name] for f in fields(ForwardRequest)})


def embedding_refs(prepared: PreparedRequest) -> list[EmbeddingRef]:
    """A prepared request's items as the LLM side names them (an inline value goes along)."""
    return [
        EmbeddingRef(
            ref=list(it.ref),
            offset=it.offset,
            length=it.length,
            mm_hash=it.mm_hash,
            modality=it.modality,
            grid_thw=it.grid_thw,
            second_per_grid_ts=it.second_per_grid_ts,
            rows=it.rows,
            value=it.value,
        )
        for it in prepared.items
    ]


def request_spec(
    request_id: str,
    prompt_token_ids: list[int],
    items: Sequence[EmbeddingRef],
    params: SamplingParams,
    block_size: int,
    *,
    ingress_id: str = "",
    cache_salt: str | None = None,
) -> LLMRequestSpec:
    """The spec an LLM replica takes, with the block hashes its router chooses a replica by."""
    spans = [(m.offset, m.length, m.mm_hash) for m in items]
    hashes = compute_block_hashes(prompt_token_ids, spans, block_size, cache_salt=cache_salt)
    return LLMRequestSpec(
        request_id,
        prompt_token_ids,
        params,
        list(items),
        hashes,
        ingress_id=ingress_id,
        cache_salt=cache_salt,
    )


class PreparedForwarder:
    """Submits prepared requests to the LLM pool from the replica that prepared them.

    ``llm`` is the LLM deployment's handle (its prefix-affinity router chooses the replica)."""

    def __init__(self, llm: Any, block_size: int, max_model_len: int) -> None:
        self.llm = llm
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.forwarded = 0
        self.declined = 0  # left to the ingress: did not fit, or the LLM pool refused or failed

    async def forward(self, prepared: PreparedRequest, fwd: ForwardRequest) -> tuple[str, str] | None:
        """Submitted: (LLM replica id, output channel id); None: the ingress submits it itself."""
        try:
            params = fit_to_prompt(
                fwd.sampling_params,
                fwd.requested_max_tokens,
                len(prepared.prompt_token_ids),
                self.max_model_len,
            )
        except APIError:  # the ingress answers the same 400
            self.declined += 1
            return None
        spec = request_spec(
            fwd.request_id,
            list(prepared.prompt_token_ids),
            embedding_refs(prepared),
            params,
            self.block_size,
            ingress_id=fwd.ingress_id,
            cache_salt=fwd.cache_salt,
        )
        try:
            reply: SubmitReply = await self.llm.submit_detached.remote(spec)
        except Exception as e:  # not taken there: the ingress submits it and handles the error
            self.declined += 1
            logger.info(
                "forwarding %s to the LLM pool failed (%r); the ingress submits it", fwd.request_id, e
            )
            return None
        self.forwarded += 1
        return (reply.replica_id, reply.channel_id)

    def stats(self) -> dict[str, int]:
        return {"forwarded_submits": self.forwarded, "declined_forwards": self.declined}
