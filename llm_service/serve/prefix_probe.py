"""How much of a request's prompt an LLM replica's prefix cache holds now: the hint ``submit`` uses to
skip fetching the embeddings of items whose whole span is cached (llm_service/serve/deployment.py)."""

from __future__ import annotations

import logging
from typing import Any

from llm_service.request_spec import LLMRequestSpec
from llm_service.sequence import Request

logger = logging.getLogger("mmserve.llm")


def cached_prefix_tokens(engine: Any, spec: LLMRequestSpec) -> int:
    """How many leading prompt tokens ``engine``'s prefix cache holds for ``spec`` now. Read on
    the event loop while a step may run on the engine thread, so only a hint: the scheduler
    checks again when it admits the request, and parks it if an unfetched item fell out."""
    kv = getattr(engine, "kv", None)
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
