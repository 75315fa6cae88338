"""``/v1/completions`` with the ``openai`` client (``client.completions.create``), streamed and not:
the four prompt forms, choices in prompt order, echo, echo with the prompt's logprobs (what
lm-eval's loglikelihood reads), stop strings, seeds, the refusals; greedy answers and prompt
logprobs against transformers on the same prompt ids."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from openai import BadRequestError, OpenAI
from transformers import AutoTokenizer

from tests.hf_oracle import hf_generate_ids, hf_prompt_logprobs
from tests.integration.e2e.common import MAX_TOKENS, PORT, VL

URL = f"http://127.0.0.1:{PORT}/v1/completions"


@pytest.fixture(scope="module")
def tok(app: dict[str, Any]) -> Any:
    return AutoTokenizer.from_pretrained(app["dirs"][VL])


def _prompt() -> str:
    return f"{uuid.uuid4().hex} the quick brown fox jumps over"  # never seen before


def _hf_text(app: dict[str, Any], tok: Any, ids: list[int], n: int = MAX_TOKENS) -> str:
    return str(tok.decode(hf_generate_ids(app["dirs"][VL], ids, n), skip_special_tokens=True))


def test_a_string_prompt_is_hfs_greedy_answer(client: OpenAI, app: dict[str, Any], tok: Any) -> None:
    prompt = _prompt()
    r = client.completions.create(model=VL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == _hf_text(app, tok, tok.encode(prompt))
    assert r.usage is not None and r.usage.prompt_tokens == len(tok.encode(prompt))
    assert r.choices[0].finish_reason in ("stop", "length")


def test_token_id_prompts_and_a_list_keep_prompt_order(client: OpenAI, app: dict[str, Any], tok: Any) -> None:
    texts = [_prompt(), _prompt() + " again", _prompt()[:12]]
    ids = [tok.encode(t) for t in texts]
    want = [_hf_text(app, tok, i) for i in ids]
    by_text = client.completions.create(model=VL, prompt=texts, max_tokens=MAX_TOKENS, temperature=0)
    by_ids = client.completions.create(model=VL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    one = client.completions.create(model=VL, prompt=ids[1], max_tokens=MAX_TOKENS, temperature=0)
    for r in (by_text, by_ids):
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert [c.text for c in r.choices] == want
        assert r.usage is not None and r.usage.prompt_tokens == sum(len(i) for i in ids)
    assert one.choices[0].text == want[1]


def test_n_per_prompt_indexes_prompt_major_and_seeds_repeat(client: OpenAI) -> None:
    ask = {
        "model": VL,
        "prompt": [_prompt(), _prompt()],
        "max_tokens": 6,
        "temperature": 1.0,
        "n": 2,
        "seed": 5,
    }
    r = client.completions.create(**ask)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    again = client.completions.create(**ask)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    alone = client.completions.create(**{**ask, "prompt": ask["prompt"][1], "n": 1, "seed": 6})
    assert alone.choices[0].text == r.choices[3].text  # prompt 1's choice 1 samples with seed + 1
    other = client.completions.create(**{**ask, "seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in r.choices]


def test_streamed_pieces_reassemble_to_the_whole_answer(client: OpenAI) -> None:
    ask = {"model": VL, "prompt": [_prompt(), _prompt()], "max_tokens": 10, "temperature": 0, "echo": True}
    whole = client.completions.create(**ask)
    parts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **ask):
        assert chunk.object == "text_completion"
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert parts == {c.index: c.text for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]


def test_echo_puts_the_prompt_first(client: OpenAI, app: dict[str, Any], tok: Any) -> None:
    prompt = _prompt()
    r = client.completions.create(model=VL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, echo=True)
    assert r.choices[0].text == prompt + _hf_text(app, tok, tok.encode(prompt))
    ids = tok.encode(prompt)
    by_ids = client.completions.create(model=VL, prompt=ids, max_tokens=1, temperature=0, echo=True)
    assert by_ids.choices[0].text.startswith(tok.decode(ids))


def test_echo_with_logprobs_scores_the_prompt_as_hf_does(
    client: OpenAI, app: dict[str, Any], tok: Any
) -> None:
    """lm-eval's loglikelihood request: echo, logprobs=1, max_tokens=1, token ids."""
    ids = tok.encode(_prompt())
    r = client.completions.create(model=VL, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(ids) + 1  # the prompt's tokens, then the generated one
    assert lp.token_logprobs[0] is None and lp.top_logprobs is not None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(
        hf_prompt_logprobs(app["dirs"][VL], ids), abs=1e-3
    )
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert top is not None and top[token] == value and len(top) <= 2  # the top-1 and the token itself
    again = client.completions.create(
        model=VL, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    assert again.choices[0].logprobs.token_logprobs == lp.token_logprobs  # type: ignore[union-attr]
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # a scored prompt skips the prefix cache


def test_logprobs_without_echo_cover_the_generated_tokens(client: OpenAI) -> None:
    r = client.completions.create(model=VL, prompt=_prompt(), max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == r.usage.completion_tokens  # type: ignore[union-attr]
    assert lp.text_offset is not None and lp.text_offset[0] == 0
    assert all(top is not None and len(top) >= 2 for top in lp.top_logprobs or [])


def test_a_stop_string_ends_the_answer_before_it(client: OpenAI) -> None:
    prompt = _prompt()
    ask = {"model": VL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    text = client.completions.create(**ask, extra_body={"ignore_eos": True}).choices[0].text
    stop = text[3:6]
    assert len(stop) == 3
    cut = client.completions.create(**ask, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_the_default_max_tokens_is_16(client: OpenAI) -> None:
    r = client.completions.create(model=VL, prompt=_prompt(), temperature=0, extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == 16


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "a", "suffix": "b"}, "suffix"),
        ({"prompt": [0, 10**8]}, "prompt"),
        ({"prompt": "a", "best_of": 2}, "best_of"),
        ({"prompt": "a", "messages": []}, "messages"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "a", "max_tokens": 10**6}, "max_tokens"),
    ],
)
def test_refusals_name_their_field(app: dict[str, Any], body: dict[str, Any], param: str) -> None:
    r = httpx.post(URL, json={"model": VL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_the_openai_client_sees_a_bad_request(client: OpenAI) -> None:
    with pytest.raises(BadRequestError) as e:
        client.completions.create(model=VL, prompt="a", suffix="b")
    assert "suffix" in str(e.value)


def test_streamed_logprobs_reassemble_to_the_whole_ones(client: OpenAI, tok: Any) -> None:
    ask = {"model": VL, "prompt": tok.encode(_prompt()), "max_tokens": 6, "temperature": 0, "echo": True}
    whole = client.completions.create(logprobs=2, n=2, **ask)
    tokens: dict[int, list[str]] = {}
    values: dict[int, list[float | None]] = {}
    offsets: dict[int, list[int]] = {}
    for chunk in client.completions.create(logprobs=2, n=2, stream=True, **ask):
        for c in chunk.choices:
            assert c.logprobs is not None
            tokens.setdefault(c.index, []).extend(c.logprobs.tokens or [])
            values.setdefault(c.index, []).extend(c.logprobs.token_logprobs or [])
            offsets.setdefault(c.index, []).extend(c.logprobs.text_offset or [])
    for c in whole.choices:
        assert c.logprobs is not None
        assert tokens[c.index] == c.logprobs.tokens
        want = c.logprobs.token_logprobs or []
        assert values[c.index][0] is None and want[0] is None  # the prompt's first token
        assert values[c.index][1:] == pytest.approx(want[1:])
        assert offsets[c.index] == c.logprobs.text_offset
