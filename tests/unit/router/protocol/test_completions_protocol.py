"""``/v1/completions``' request (router/protocol/completions.py): the prompt's four forms, the bounds
it shares with chat (``SamplingFields``), unknown fields refused by name, and the logprobs shape."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from cluster.bench.fuzz.asgi import request
from router.http.completion_events import Echo, completion_logprobs
from router.http.request_body import read_body
from router.protocol.chat_output import TokenLogprobEntry, TopLogprob
from router.protocol.completions import MAX_CHOICES, MAX_PROMPTS, CompletionRequest
from router.protocol.errors import APIError
from router.protocol.sampling import request_sampling_params, to_sampling_params


def parse(**body: Any) -> CompletionRequest:
    body.setdefault("model", "m")
    raw = json.dumps(body).encode()
    return asyncio.run(read_body(request(raw, "/"), CompletionRequest, 1 << 20, 16_384))


def refused(**body: Any) -> APIError:
    with pytest.raises(APIError) as e:
        parse(**body)
    assert e.value.status_code == 400
    return e.value


@pytest.mark.parametrize(
    "prompt, prompts",
    [
        ("hello", ["hello"]),
        (["a", "b c"], ["a", "b c"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
    ids=["string", "strings", "ids", "lists-of-ids"],
)
def test_the_four_prompt_forms(prompt: Any, prompts: list[Any]) -> None:
    assert parse(prompt=prompt).prompts == prompts


@pytest.mark.parametrize(
    "prompt, words",
    [
        ("", "prompt 0 is empty"),
        ([], "at least one prompt"),
        (["a", ""], "prompt 1 is empty"),
        ([[1], []], "prompt 1 is empty"),
        ([1, -2], "non-negative"),
        (["a"] * (MAX_PROMPTS + 1), f"at most {MAX_PROMPTS} prompts"),
        ([1, "a"], ""),  # mixed ids and text: none of the four forms
        ({"text": "a"}, ""),
    ],
)
def test_bad_prompts_are_400s_naming_prompt(prompt: Any, words: str) -> None:
    e = refused(prompt=prompt)
    assert e.param is not None and e.param.startswith("prompt")
    assert words in e.message


def test_choices_are_bounded_over_prompts_times_n() -> None:
    parse(prompt=["a"] * 8, n=MAX_CHOICES // 8)
    assert "choices" in refused(prompt=["a"] * (MAX_CHOICES // 16 + 1), n=16).message


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 2.5),
        ("top_p", 0.0),
        ("presence_penalty", -3),
        ("logit_bias", {"x": 1}),
        ("stop", ["a"] * 5),
        ("stop_token_ids", [-1]),
        ("n", 17),
        ("logprobs", 21),
        ("logprobs", -1),
        ("max_tokens", 0),
        ("cache_salt", ""),
    ],
)
def test_the_shared_bounds_name_their_field(field: str, value: Any) -> None:
    assert refused(prompt="a", **{field: value}).param == field


@pytest.mark.parametrize("field", ["messages", "response_format", "top_logprobs", "best_of", "tools"])
def test_unknown_fields_are_refused_by_name(field: str) -> None:
    e = refused(prompt="a", **{field: 1})
    assert e.code == "unrecognized_argument" and e.param == field
    assert e.message.startswith(f"Unrecognized request argument supplied: {field}")


def test_min_tokens_above_max_tokens_is_refused() -> None:
    assert "min_tokens" in refused(prompt="a", max_tokens=2, min_tokens=3).message


def test_the_request_maps_to_the_engines_params() -> None:
    req = parse(
        prompt="a",
        temperature=0.5,
        top_k=4,
        seed=7,
        stop=["x"],
        logprobs=3,
        min_p=0.1,
        logit_bias={"5": -100},
        stop_token_ids=[9],
        ignore_eos=True,
        structured_outputs={"regex": "[ab]+"},
        max_tokens=5,
    )
    p = request_sampling_params(req)
    assert (p.temperature, p.top_k, p.seed, p.logprobs, p.min_p) == (0.5, 4, 7, 3, 0.1)
    assert p.logit_bias == ((5, -100.0),) and p.stop_token_ids == (9,) and p.ignore_eos
    assert p.structured is not None and p.structured.kind == "regex"
    assert p.prompt_logprobs is None  # asked only for an echo (router/http/completions.py)
    assert req.stop_strings == ["x"]
    assert to_sampling_params(req, 10, 64).max_tokens == 5
    assert parse(prompt="a").sampled_logprobs is None


def test_a_prompt_too_long_names_prompt() -> None:
    from router.protocol.sampling import fit_to_prompt

    req = parse(prompt="a")
    with pytest.raises(APIError) as e:
        fit_to_prompt(request_sampling_params(req), None, 64, 64, "prompt")
    assert e.value.param == "prompt" and e.value.code == "prompt_too_long"


def test_logprobs_in_the_completions_shape() -> None:
    def entry(tok: str, lp: float, *top: tuple[str, float]) -> TokenLogprobEntry:
        return TokenLogprobEntry(
            token=tok, logprob=lp, top_logprobs=[TopLogprob(token=t, logprob=v) for t, v in top]
        )

    echo = Echo("ab c", "ab", (entry(" c", -1.0, ("x", -0.5)),))
    got = echo.logprobs()
    assert got.tokens == ["ab", " c"]
    assert got.token_logprobs == [None, -1.0]
    assert got.top_logprobs == [None, {"x": -0.5, " c": -1.0}]  # the token itself among its alternatives
    assert got.text_offset == [0, 2]
    gen = completion_logprobs([entry("d", -0.1, ("d", -0.1)), entry("ef", -2.0)], len(echo.text))
    assert gen.text_offset == [4, 5] and gen.top_logprobs == [{"d": -0.1}, {"ef": -2.0}]
