"""What the ingress hands the LLM pool: a prepared request's items as the LLM side names them, and the
``LLMRequestSpec`` with the block hashes its router chooses a replica by."""

from __future__ import annotations

from collections.abc import Sequence

from encoder_service.preprocess.prepared import PreparedItem
from llm_service.prefix_hash import compute_block_hashes
from llm_service.request_spec import EmbeddingRef, LLMRequestSpec
from llm_service.sampling_params import SamplingParams


def embedding_refs(items: Sequence[PreparedItem]) -> list[EmbeddingRef]:
    """A prepared request's items as the LLM side names them (an inline value goes along; an item
    still encoding has no ref yet)."""
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
        for it in items
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
    trace_headers: dict[str, str] | None = None,
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
        trace_headers=trace_headers,
    )
