"""Every sampling value the API accepts is one the engine samples safely; every other is a 400 that
names its field."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from llm_service.sampler import sample
from llm_service.sampling_params import SamplingParams
from router.protocol.errors import APIError
from router.protocol.openai import ChatCompletionRequest
from router.protocol.sampling import to_sampling_params

MSG = [{"role": "user", "content": "hi"}]


def parse(raw: str) -> ChatCompletionRequest:
    """As the ingress parses a body: ``json.loads`` (which accepts NaN and Infinity) then pydantic."""
    payload = json.loads(raw)
    payload.setdefault("model", "m")
    payload.setdefault("messages", MSG)
    return ChatCompletionRequest.model_validate(payload)


@pytest.mark.parametrize(
    "raw, field",
    [
        ('{"temperature": NaN}', "temperature"),
        ('{"temperature": Infinity}', "temperature"),
        ('{"temperature": -1e-300}', "temperature"),
        ('{"temperature": 2.0000001}', "temperature"),
        ('{"top_p": NaN}', "top_p"),
        ('{"top_p": 0}', "top_p"),
        ('{"top_p": 1.5}', "top_p"),
        ('{"top_k": -2}', "top_k"),
        ('{"top_k": 4294967296}', "top_k"),
        ('{"seed": 9223372036854775808}', "seed"),
        ('{"seed": -9223372036854775809}', "seed"),
        ('{"max_tokens": 0}', "max_tokens"),
        ('{"max_tokens": 1e400}', "max_tokens"),
        ('{"max_completion_tokens": 4294967296}', "max_completion_tokens"),
        ('{"logprobs": true, "top_logprobs": 21}', "top_logprobs"),
        ('{"presence_penalty": 2.5}', "presence_penalty"),
        ('{"frequency_penalty": -Infinity}', "frequency_penalty"),
        ('{"frequency_penalty": 3}', "frequency_penalty"),
        ('{"logit_bias": {"42": 101}}', "logit_bias"),
        ('{"logit_bias": {"x": 1}}', "logit_bias"),
        ('{"logit_bias": {' + ", ".join(f'"{i}": 1' for i in range(301)) + "}}", "logit_bias"),
        ('{"repetition_penalty": 0}', "repetition_penalty"),
        ('{"min_p": 1.5}', "min_p"),
        ('{"stop_token_ids": [-1]}', "stop_token_ids"),
        ('{"response_format": {"type": "json_schema"}}', "response_format"),
        ('{"response_format": {"type": "xml"}}', "response_format"),
        ('{"structured_outputs": {"regex": "a", "choice": ["b"]}}', "structured_outputs"),
        ('{"tools": []}', "tools"),
        ('{"unknown_field": 1}', "unknown_field"),
        ('{"stop": ["a", "b", "c", "d", "e"]}', "stop"),
        ('{"stop": ""}', "stop"),
        ('{"stop": "' + "x" * 257 + '"}', "stop"),
        ('{"n": 17}', "n"),
    ],
)
def test_out_of_range_sampling_fields_are_refused_by_name(raw: str, field: str) -> None:
    with pytest.raises(ValidationError) as e:
        parse(raw)
    first = e.value.errors()[0]
    assert first["loc"][0] == field, first  # the ingress turns loc into the 400's ``param``


def test_neutral_values_and_harmless_openai_fields_are_accepted() -> None:
    req = parse(
        '{"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "stop": ["a", "b"],'
        ' "user": "u1", "metadata": {"k": "v"}, "store": false, "service_tier": "auto"}'
    )
    assert req.stop_strings == ["a", "b"]


def test_max_tokens_beyond_the_room_is_a_400_naming_max_tokens() -> None:
    with pytest.raises(APIError) as e:
        to_sampling_params(parse('{"max_tokens": 100}'), 30, 64)
    assert e.value.status_code == 400 and e.value.param == "max_tokens"


finite = st.floats(allow_nan=False, allow_infinity=False)
any_float = st.one_of(
    st.floats(),  # NaN, infinities, subnormals (1e-300 and below) included
    st.sampled_from([0.0, 5e-324, 1e-300, 1e-7, 9.99e-6, 1e-5, 2.0, 1.0, 1e-45]),
)


@settings(max_examples=300, deadline=None)
@given(
    temperature=st.one_of(st.none(), any_float),
    top_p=st.one_of(st.none(), any_float),
    top_k=st.one_of(st.none(), st.integers(-3, 1 << 32)),
    seed=st.one_of(st.none(), st.integers(-(1 << 64), 1 << 65)),
    top_logprobs=st.one_of(st.none(), st.integers(-1, 25)),
    logit_scale=st.sampled_from([1.0, 1e4, 1e30, 3e38]),
)
def test_every_accepted_value_samples_safely(
    temperature: Any, top_p: Any, top_k: Any, seed: Any, top_logprobs: Any, logit_scale: float
) -> None:
    body: dict[str, Any] = {"model": "m", "messages": MSG}
    for name, v in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", seed)):
        if v is not None:
            body[name] = v
    if top_logprobs is not None:
        body.update(logprobs=True, top_logprobs=top_logprobs)
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError:
        return
    params = to_sampling_params(req, 10, 64)
    params.validate()  # the engine would admit it
    gen = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
    logits = (torch.rand(2, 50, generator=torch.Generator().manual_seed(1)) * 2 - 1) * logit_scale
    tokens, lps = sample(logits, [params, params], [gen, gen])
    assert all(0 <= t < 50 for t in tokens)
    if params.greedy:
        assert tokens == logits.argmax(-1).tolist()
    for lp in lps:
        values = [] if lp is None else [lp.logprob] + [v for _, v in lp.top]
        assert all(math.isfinite(v) and v <= 0.0 for v in values)  # JSON has no -Infinity


def test_greedy_threshold() -> None:
    assert SamplingParams(temperature=9.99e-6).greedy and SamplingParams(temperature=5e-324).greedy
    assert not SamplingParams(temperature=1e-5).greedy
