"""What the ingress hands the LLM pool: the ``LLMRequestSpec`` with the block hashes its router chooses
a replica by. The prepared request's item records go as they are."""

from __future__ import annotations

from collections.abc import Sequence

from llm_service.prefix_hash import compute_block_hashes
from llm_service.request_spec import LLMRequestSpec
from llm_service.sampling_params import SamplingParams
from mmcore.feature import MediaFeature


def request_spec(
    request_id: str,
    prompt_token_ids: list[int],
    items: Sequence[MediaFeature],
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
