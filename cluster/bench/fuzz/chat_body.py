"""Target: a chat-completions request body, bytes -> what the ingress does with it before any call out.

``ChatService.read_request`` (size, JSON value count, ``json.loads``, ``ChatCompletionRequest``), the
served-model lookup, the tools' checks (``template_tools``), ``normalize_messages`` (limits, ``input_audio`` base64), the modality check,
admission cost, the cache salt, the sampling parameters and their fit to a prompt: the steps of
``ChatService.chat`` up to ``orch.prepare``. Expected: a request, or an ``APIError`` with a 4xx.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, cast

from cluster.bench.fuzz.asgi import request

# The one router import. Every name below is one the ingress module itself uses, so this target calls
# what the ingress calls (and follows it if it moves again: change this line only).
from router.http import chat as ingress

LIMITS = ingress.MessageLimits(
    max_messages=16,
    max_content_parts=32,
    max_media_bytes=4096,
    limit_mm_per_prompt={"image": 2, "video": 1, "audio": 1},
)
MODEL = ingress.ServedModel("m", cast(Any, None), LIMITS, max_model_len=4096, modalities=["image", "audio"])
SERVICE = ingress.ChatService({"m": MODEL}, max_request_bytes=1 << 16, max_json_values=512)
_LOOP = asyncio.new_event_loop()


def _handle(body: bytes, tenant: str | None) -> None:
    req = _LOOP.run_until_complete(SERVICE.read_request(request(body, "/v1/chat/completions")))
    model = SERVICE.model_for(req.model)
    tools = ingress.template_tools(req.tools, req.tool_choice)  # tools_for's checks (no template here)
    chat = ingress.normalize_messages(req.messages, model.limits, tenant, tools)
    unsupported = {m.modality for m in chat.media} - set(model.modalities)
    if unsupported:  # ChatService.chat's check, as it is there
        raise ingress.bad_request(f"does not accept {sorted(unsupported)}", code="unsupported_modality")
    admission = SERVICE.admission
    admission.release(admission.admit(admission.cost((m.modality for m in chat.media), chat.text_chars)))
    ingress.effective_cache_salt(tenant, req.cache_salt)
    base, requested = ingress.request_sampling_params(req), ingress.requested_max_tokens(req)
    prompt_tokens = 1 + chat.text_chars // 4 + 256 * len(chat.media)  # a stand-in for the prepared prompt
    ingress.fit_to_prompt(base, requested, prompt_tokens, model.max_model_len)
    detok = ingress.IncrementalDetokenizer(_letters, stop=req.stop_strings)  # client stop strings
    detok.add(list(range(40)), final=True)


def _letters(ids: Sequence[int]) -> str:
    return "".join(chr(97 + i % 26) for i in ids)


def one_input(data: bytes) -> None:
    tenant = "tenant-a" if data[:1] == b" " else None  # a leading space: the server has API keys
    try:
        _handle(data, tenant)
    except ingress.APIError as e:
        if not 400 <= e.status_code < 500:
            raise
