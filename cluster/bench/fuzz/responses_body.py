"""Target: a ``/v1/responses`` body, bytes -> what the ingress does with it before any call out.

``ResponsesService.respond``'s steps up to the orchestrator: the bounded read (size, JSON value count,
``json.loads``, ``ResponsesRequest`` with its input items, tools and ``text.format``), the body budget,
``_validated`` (the stateful and hosted-tool refusals, the model lookup, input items in chat's terms
through ``normalize_messages``, the tools' checks, the modality check, sampling parameters with
``text.format`` and ``tool_choice``), admission cost, the cache salt, and ``max_output_tokens`` fitted to a
stand-in prompt. Expected: a request, or an ``APIError`` with a 4xx.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

from cluster.bench.fuzz.asgi import request
from mmcore.feature import MODALITIES
from router.http import chat as ingress
from router.http import responses
from router.http.request_body import read_body
from router.protocol.responses import ResponsesRequest
from router.routing.admission import BodyLease

LIMITS = ingress.MessageLimits(
    max_messages=16,
    max_content_parts=32,
    max_media_bytes=4096,
    limit_mm_per_prompt={"image": 2, "audio": 1},
)
# what ``_validated`` reads of the orchestrator: tools rendered, and media in tool results too
_ORCH = SimpleNamespace(template_takes_tools=True, tool_result_modalities=MODALITIES)
MODEL = ingress.ServedModel("m", cast(Any, _ORCH), LIMITS, max_model_len=4096, modalities=["image"])
SERVICE = responses.ResponsesService(
    ingress.ChatService({"m": MODEL}, max_request_bytes=1 << 16, max_json_values=512)
)
_LOOP = asyncio.new_event_loop()


def _handle(body: bytes, tenant: str | None) -> None:
    chat = SERVICE.chat
    lease = BodyLease()
    try:
        req = _LOOP.run_until_complete(
            read_body(
                request(body, "/v1/responses"),
                ResponsesRequest,
                chat.max_request_bytes,
                chat.max_json_values,
                lambda n: chat.admission.reserve_body(lease, n),
            )
        )
        asked = SERVICE._validated(req, tenant)
        normalized = asked.chat
        cost = chat.admission.cost((m.modality for m in normalized.media), normalized.text_chars)
        chat.admission.release(chat.admission.admit(cost, body=lease))
        ingress.effective_cache_salt(tenant, req.cache_salt)
        prompt = 1 + normalized.text_chars // 4 + 256 * len(normalized.media)  # a stand-in prompt
        ingress.fit_to_prompt(
            asked.params, req.max_output_tokens, prompt, MODEL.max_model_len, "input", "max_output_tokens"
        )
    finally:
        chat.admission.release_body(lease)


def one_input(data: bytes) -> None:
    tenant = "tenant-a" if data[:1] == b" " else None  # a leading space: the server has API keys
    try:
        _handle(data, tenant)
    except ingress.APIError as e:
        if not 400 <= e.status_code < 500:
            raise
