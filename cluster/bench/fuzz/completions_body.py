"""Target: a ``/v1/completions`` body, bytes -> what the ingress does with it before any call out.

``CompletionService.complete``'s steps up to the orchestrator: the bounded read (size, JSON value
count, ``json.loads``, ``CompletionRequest`` with its prompt forms and bounds), the body budget, the
``suffix`` refusal, the served-model lookup, admission cost, the cache salt, token-id prompts checked
against a vocabulary, and the sampling parameters fitted to each prompt. Expected: a request, or an
``APIError`` with a 4xx.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

# What the completions route itself calls; the chat target's module holds the shared service types.
from cluster.bench.fuzz.asgi import request
from router.http import chat as ingress
from router.http import completions
from router.http.request_body import read_body
from router.protocol.completions import CompletionRequest
from router.protocol.errors import bad_request
from router.routing.admission import BodyLease

VOCAB = 1024
LIMITS = ingress.MessageLimits(
    max_messages=16, max_content_parts=32, max_media_bytes=4096, limit_mm_per_prompt={"image": 2}
)
MODEL = ingress.ServedModel("m", cast(Any, None), LIMITS, max_model_len=4096, modalities=["image"])
SERVICE = completions.CompletionService(
    ingress.ChatService({"m": MODEL}, max_request_bytes=1 << 16, max_json_values=512)
)
_LOOP = asyncio.new_event_loop()


def _prompt_ids(prompt: str | list[int]) -> list[int]:
    """A stand-in tokenizer for strings; ids checked as ``Orchestrator.check_prompt_ids`` checks them."""
    if isinstance(prompt, str):
        return [ord(c) % VOCAB for c in prompt[:4096]] or [0]
    bad = [t for t in prompt if not 0 <= t < VOCAB]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary", param="prompt")
    return list(prompt)


def _handle(body: bytes, tenant: str | None) -> None:
    chat = SERVICE.chat
    lease = BodyLease()
    req = _LOOP.run_until_complete(
        read_body(
            request(body, "/v1/completions"),
            CompletionRequest,
            chat.max_request_bytes,
            chat.max_json_values,
            lambda n: chat.admission.reserve_body(lease, n),
        )
    )
    try:
        if req.suffix is not None:  # CompletionService.complete's refusal
            raise bad_request("suffix is not supported", param="suffix")
        model = chat.model_for(req.model)
        cost = sum(chat.admission.cost((), len(p) if isinstance(p, str) else 0) for p in req.prompts)
        chat.admission.release(chat.admission.admit(cost * req.n, body=lease))
        ingress.effective_cache_salt(tenant, req.cache_salt)
        for p in req.prompts:
            SERVICE._params(req, model, _prompt_ids(p))
    finally:
        chat.admission.release_body(lease)


def one_input(data: bytes) -> None:
    tenant = "tenant-a" if data[:1] == b" " else None  # a leading space: the server has API keys
    try:
        _handle(data, tenant)
    except ingress.APIError as e:
        if not 400 <= e.status_code < 500:
            raise
