"""OpenAI request parameters -> the engine's SamplingParams.

Two steps, because a media request's prompt length is known only once it is prepared (on an encoder
replica): ``request_sampling_params`` reads the request, and
``fit_to_prompt`` sets ``max_tokens`` against the prompt (the rest of ``max_model_len`` unless asked).
"""

from __future__ import annotations

import json
from dataclasses import replace

from llm_service.sampling_params import SamplingParams
from llm_service.structured.spec import StructuredSpec, canonical_json, spec_problem
from router.protocol.errors import bad_request
from router.protocol.openai import SamplingFields


def requested_max_tokens(req: SamplingFields) -> int | None:
    return req.requested_max_tokens


def request_sampling_params(req: SamplingFields) -> SamplingParams:
    """Everything but a fitted ``max_tokens`` (set to what was asked, or 1 until ``fit_to_prompt``)."""
    return SamplingParams(
        max_tokens=requested_max_tokens(req) or 1,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        seed=req.seed,
        ignore_eos=req.ignore_eos,
        logprobs=req.sampled_logprobs,
        min_p=req.min_p or 0.0,
        min_tokens=req.min_tokens,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=tuple((int(t), float(b)) for t, b in (req.logit_bias or {}).items()),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        structured=structured_spec(req),
    )


def structured_spec(req: SamplingFields) -> StructuredSpec | None:
    """The request's output constraint (``response_format`` or ``structured_outputs``), bounded
    here (a 400 naming the field before anything is compiled); None for free text."""
    spec = _spec(req)
    if spec is not None and (problem := spec_problem(spec)) is not None:
        raise bad_request(f"{spec.field}: {problem}", code="bad_structured_output", param=spec.field)
    return spec


def _spec(req: SamplingFields) -> StructuredSpec | None:
    rf, so = req.format_request, req.structured_outputs
    if rf is not None and rf.type == "json_object":
        return StructuredSpec("json_object", "", req.format_field)
    if rf is not None and rf.json_schema is not None:
        given = rf.json_schema.schema_
        return StructuredSpec.json_schema(given if given is not None else {}, req.format_field)
    if so is None:
        return None
    if so.json_ is not None:
        schema: object = so.json_
        if isinstance(so.json_, str):  # vLLM takes the schema as a JSON string too
            try:
                schema = json.loads(so.json_)
            except ValueError as e:
                raise bad_request(
                    f"structured_outputs.json is not valid JSON: {e}", param="structured_outputs"
                ) from e
        return StructuredSpec("json", canonical_json(schema))
    if so.regex is not None:
        return StructuredSpec("regex", so.regex)
    if so.choice is not None:
        return StructuredSpec.choice(so.choice)
    if so.grammar is not None:
        return StructuredSpec("grammar", so.grammar)
    return StructuredSpec("json_object", "")


def fit_to_prompt(
    params: SamplingParams,
    requested: int | None,
    num_prompt_tokens: int,
    max_model_len: int,
    prompt_field: str = "messages",
    max_tokens_field: str = "max_tokens",
) -> SamplingParams:
    """``params`` with ``max_tokens`` set for this prompt; a 400 naming the problem if it cannot fit
    (``prompt_field``, ``max_tokens_field``: the request fields that hold the prompt and the bound)."""
    room = max_model_len - num_prompt_tokens
    if room <= 0:
        raise bad_request(
            f"the prompt has {num_prompt_tokens} tokens; max_model_len is {max_model_len}",
            code="prompt_too_long",
            param=prompt_field,
        )
    if requested is not None and requested > room:
        raise bad_request(
            f"{max_tokens_field}={requested} plus the prompt's {num_prompt_tokens} tokens exceeds "
            f"max_model_len={max_model_len}",
            code="max_tokens_too_large",
            param=max_tokens_field,
        )
    return replace(params, max_tokens=requested or room)


def to_sampling_params(req: SamplingFields, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    return fit_to_prompt(
        request_sampling_params(req), requested_max_tokens(req), num_prompt_tokens, max_model_len
    )
