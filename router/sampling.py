"""OpenAI request parameters -> the engine's SamplingParams."""

from __future__ import annotations

from llm_service.sampling_params import SamplingParams
from router.errors import bad_request
from router.protocol import ChatCompletionRequest


def to_sampling_params(
    req: ChatCompletionRequest, num_prompt_tokens: int, max_model_len: int
) -> SamplingParams:
    room = max_model_len - num_prompt_tokens
    if room <= 0:
        raise bad_request(
            f"the prompt has {num_prompt_tokens} tokens; max_model_len is {max_model_len}",
            code="prompt_too_long",
            param="messages",
        )
    requested = req.max_completion_tokens or req.max_tokens
    if requested is not None and requested > room:
        raise bad_request(
            f"max_tokens={requested} plus the prompt's {num_prompt_tokens} tokens exceeds max_model_len={max_model_len}",
            code="max_tokens_too_large",
            param="max_tokens",
        )
    return SamplingParams(
        max_tokens=requested or room,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        seed=req.seed,
        ignore_eos=req.ignore_eos,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
    )
