"""OpenAI request parameters -> the engine's SamplingParams.

Two steps, because a media request's prompt length is known only once it is prepared (on an encoder
replica): ``request_sampling_params`` reads the request, and
``fit_to_prompt`` sets ``max_tokens`` against the prompt (the rest of ``max_model_len`` unless asked).
"""

from __future__ import annotations

from dataclasses import replace

from llm_service.sampling_params import SamplingParams
from router.protocol.errors import bad_request
from router.protocol.openai import ChatCompletionRequest


def requested_max_tokens(req: ChatCompletionRequest) -> int | None:
    return req.max_completion_tokens or req.max_tokens


def request_sampling_params(req: ChatCompletionRequest) -> SamplingParams:
    """Everything but a fitted ``max_tokens`` (set to what was asked, or 1 until ``fit_to_prompt``)."""
    return SamplingParams(
        max_tokens=requested_max_tokens(req) or 1,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        seed=req.seed,
        ignore_eos=req.ignore_eos,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
    )


def fit_to_prompt(
    params: SamplingParams, requested: int | None, num_prompt_tokens: int, max_model_len: int
) -> SamplingParams:
    """``params`` with ``max_tokens`` set for this prompt; a 400 naming the problem if it cannot fit."""
    room = max_model_len - num_prompt_tokens
    if room <= 0:
        raise bad_request(
            f"the prompt has {num_prompt_tokens} tokens; max_model_len is {max_model_len}",
            code="prompt_too_long",
            param="messages",
        )
    if requested is not None and requested > room:
        raise bad_request(
            f"max_tokens={requested} plus the prompt's {num_prompt_tokens} tokens exceeds max_model_len={max_model_len}",
            code="max_tokens_too_large",
            param="max_tokens",
        )
    return replace(params, max_tokens=requested or room)


def to_sampling_params(
    req: ChatCompletionRequest, num_prompt_tokens: int, max_model_len: int
) -> SamplingParams:
    return fit_to_prompt(
        request_sampling_params(req), requested_max_tokens(req), num_prompt_tokens, max_model_len
    )
