"""Thinking over HTTP with the real ``openai`` client, on the tiny Qwen3.5 (its released template, whose
generation prompt opens ``<think>``) served with ``reasoning_parser: auto`` (the family's ``qwen3``):
the greedy answer is all reasoning (vLLM 0.32's ``reasoning`` field, streamed as ``delta.reasoning``)
and equals HF's greedy text; ``chat_template_kwargs: {"enable_thinking": false}`` puts it in ``content``,
equal to HF's on the prompt rendered with that kwarg; a grammar while thinking is a 400 naming both fields;
``/v1/responses`` answers with a ``reasoning`` item and counts ``reasoning_tokens``.

Its own one-model app: the tools package's shared app serves Qwen3.5 without a reasoning parser (its
forced-output tests need grammars, which a thinking Qwen3.5 refuses)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from tests.hf_oracle import hf_generate_ids
from tests.integration.local_app import local_app

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3.5"
ASK = [{"role": "user", "content": "What is two plus two?"}]
OFF = {"enable_thinking": False}


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[OpenAI, Path]]:
    cache_dir = tmp_path_factory.mktemp("models")
    model = {
        "name": MODEL,
        "tiny": "qwen3.5",
        "reasoning_parser": "auto",
        "llm": {"block_size": 16, "max_model_len": 1024, "num_kv_blocks": 128},
        "encoder": {"cache_index_shards": 1},
    }
    with local_app({"models": [model], "models_cache_dir": str(cache_dir)}) as client:
        yield client, Path(cache_dir) / MODEL


def _hf_text(model_dir: Path, kwargs: dict[str, Any], max_tokens: int) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, **kwargs)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return str(tok.decode(hf_generate_ids(model_dir, list(ids), max_tokens), skip_special_tokens=True))


def test_thinking_answer_is_reasoning_streamed_and_not_equal_to_hf(app: tuple[OpenAI, Path]) -> None:
    client, model_dir = app
    want = _hf_text(model_dir, {}, 12)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    message = r.choices[0].message
    assert (message.model_extra or {}).get("reasoning") == want and message.content is None
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0, stream=True)  # type: ignore[arg-type]
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas) == want
    assert "".join(d.content or "" for d in deltas) == ""


def test_thinking_off_by_chat_template_kwargs_is_content_equal_to_hf(app: tuple[OpenAI, Path]) -> None:
    client, model_dir = app
    want = _hf_text(model_dir, OFF, 12)
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        extra_body={"chat_template_kwargs": OFF},
    )
    message = r.choices[0].message
    assert message.content == want and (message.model_extra or {}).get("reasoning") is None


def test_grammar_while_thinking_and_reserved_kwargs_are_400s_naming_the_field(
    app: tuple[OpenAI, Path],
) -> None:
    client, _ = app
    forced = {"structured_outputs": {"regex": "[0-9]{3}"}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=forced)  # type: ignore[arg-type]
    assert e.value.body["param"] == "structured_outputs" and "chat_template_kwargs" in e.value.body["message"]  # type: ignore[index]
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        max_tokens=4,
        extra_body={**forced, "chat_template_kwargs": OFF},
    )
    assert re.fullmatch("[0-9]{3}", r.choices[0].message.content or "")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,  # type: ignore[arg-type]
            extra_body={"chat_template_kwargs": {"add_generation_prompt": False}},
        )
    assert (
        "chat_template_kwargs" in e.value.body["param"] and "add_generation_prompt" in e.value.body["message"]
    )  # type: ignore[index]


def test_responses_reasoning_item_and_reasoning_tokens(app: tuple[OpenAI, Path]) -> None:
    client, model_dir = app
    r = client.responses.create(
        model=MODEL, input="What is two plus two?", max_output_tokens=8, temperature=0
    )
    assert [o.type for o in r.output] == ["reasoning"]  # no end marker: all of it reasoning
    item = r.output[0]
    assert item.type == "reasoning" and item.content is not None
    assert item.content[0].text == _hf_text(model_dir, {}, 8)
    assert r.usage is not None and r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens
