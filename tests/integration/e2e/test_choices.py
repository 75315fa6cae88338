"""``n`` > 1 over HTTP with the ``openai`` client: every choice has its index, seeded choices repeat,
the choices differ, usage counts the prompt once, and the prompt is prefilled once (the other
choices read its KV blocks from the prefix cache: the LLM replica's hit counter shows it)."""

from __future__ import annotations

import uuid

from openai import OpenAI

from tests.integration.e2e.app_readings import llm_stats
from tests.integration.e2e.common import VL


def _prompt() -> str:
    return f"{uuid.uuid4().hex} " + " ".join(f"word{i}" for i in range(60))  # never seen before


def test_four_seeded_choices_repeat_differ_and_share_one_prefill(client: OpenAI) -> None:
    prompt = _prompt()
    before = llm_stats()["prefix_hit_tokens"]
    ask = {"model": VL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12}
    r = client.chat.completions.create(n=4, seed=7, temperature=1.0, **ask)
    hits = llm_stats()["prefix_hit_tokens"] - before
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) >= 3  # each choice samples with its own seed (seed + index)
    assert 4 <= r.usage.completion_tokens <= 4 * 12  # every choice's tokens, summed
    p = r.usage.prompt_tokens
    block = 16  # the tiny models' KV block (cluster/config.py default)
    assert hits >= 3 * (p // block) * block  # choices 1-3 read every full block of choice 0's prompt
    again = client.chat.completions.create(n=4, seed=7, temperature=1.0, **ask)
    assert [c.message.content for c in again.choices] == texts
    alone = client.chat.completions.create(seed=7 + 2, temperature=1.0, **ask)
    assert alone.choices[0].message.content == texts[2]  # choice i is the request with seed + i
    assert alone.usage.prompt_tokens == p  # the prompt counted once


def test_streamed_choices_reassemble_to_the_whole_ones(client: OpenAI) -> None:
    ask = {
        "model": VL,
        "messages": [{"role": "user", "content": _prompt()}],
        "max_tokens": 10,
        "n": 3,
        "seed": 3,
        "temperature": 1.0,
    }
    whole = client.chat.completions.create(**ask)
    parts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **ask):
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert parts == {c.index: c.message.content for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens
