"""Forwarded requests leave nothing behind (router/forwarding.py): with the hit path off, every media
request is prepared by the encoder replica and submitted from there (detached: no call holds it),
and the ingress adopts it, its small embeddings inline beside their refs. After 300 mixed requests, some of whose clients leave after the first
chunk, the cluster references the objects it did before, every cached embedding is referenced by
the same workers as many times as before (a request that kept its refs, anywhere, would add
references to those objects, not new objects), and no KV block, running request, reservation or
output channel is left. Real Ray Serve, real HTTP, the openai client; answers of
forwarded requests equal those the ingress submitted itself (HF equality is the e2e suite's)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.integration.e2e.common import data_url, holders, more_references, send_concurrently, wait_for
from tests.integration.e2e.test_mixed_load import _referenced_objects
from tests.integration.local_app import local_app
from tests.media import make_image_bytes

MODEL = "tiny-qwen2-vl"
NUM_REQUESTS = 300
IMAGES = [make_image_bytes(40 + 8 * i, 48, seed=700 + i) for i in range(4)]


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAI]:
    model = {
        "name": MODEL,
        "tiny": "qwen2-vl",
        "preprocess": {"placement": "encoder", "forward": True, "hit_path": False},
        "encoder": {"cache_index_shards": 1},
    }
    cache_dir = str(tmp_path_factory.mktemp("models"))
    with local_app({"models": [model], "models_cache_dir": cache_dir}) as client:
        yield client


def _handle(pool: str) -> Any:
    from ray import serve

    return serve.get_deployment_handle(f"{pool}-{MODEL}", app_name="mmserve")


def _quiet(base_url: str) -> bool:
    s = _handle("LLMServer").stats.remote().result(timeout_s=30)
    cache = httpx.get(f"{base_url.removesuffix('/v1')}/stats").json()[MODEL]["encoder_cache"]
    held = s["num_running"] or s["num_waiting"] or s["num_free_blocks"] != s["num_total_blocks"]
    return s["output_channels"] == 0 and not held and cache["reserved"] == 0


def _messages(i: int) -> list[dict[str, Any]]:
    if i % 4 == 0:
        return [{"role": "user", "content": f"text request {i}"}]
    images = [IMAGES[i % len(IMAGES)]] + ([IMAGES[(i + 1) % len(IMAGES)]] if i % 4 == 3 else [])
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": data_url(b, "image/png")}} for b in images
    ]
    return [{"role": "user", "content": [*content, {"type": "text", "text": f"image request {i}"}]}]


async def _send(client: AsyncOpenAI, i: int) -> int:
    leaves = i % 7 == 0  # its client reads one chunk and hangs up: the forwarded request is aborted
    max_tokens = 64 if leaves else random.Random(i).choice([1, 4, 8])
    body = {"model": MODEL, "messages": _messages(i), "max_tokens": max_tokens, "temperature": 0}
    if i % 2 or leaves:
        stream = await client.chat.completions.create(**body, stream=True)
        n = 0
        async for _ in stream:
            n += 1
            if leaves:
                break
        await stream.close()
        return n
    resp = await client.chat.completions.create(**body)
    return resp.usage.completion_tokens


async def _run(base_url: str, indices: list[int]) -> list[int]:
    return await send_concurrently(base_url, _send, indices, 16)


def test_forwarded_requests_leave_the_object_store_kv_and_channels_at_baseline(app: OpenAI) -> None:
    base_url = str(app.base_url).rstrip("/")
    asyncio.run(_run(base_url, list(range(1, 9))))  # every image: the cache holds them from now on
    wait_for(lambda: _quiet(base_url), 60, "the warm-up to settle")
    baseline = _referenced_objects()
    refs_before = holders()
    stats_before = _handle("EncoderPool").stats.remote().result(timeout_s=30)
    forwarded_before = stats_before["forwarded_submits"]

    assert all(n >= 1 for n in asyncio.run(_run(base_url, list(range(100, 100 + NUM_REQUESTS)))))

    media = sum(1 for i in range(100, 100 + NUM_REQUESTS) if i % 4)
    stats = _handle("EncoderPool").stats.remote().result(timeout_s=30)
    assert stats["forwarded_submits"] - forwarded_before == media  # every media request went encoder -> LLM
    # each carried its (small) embeddings inline beside their refs: the LLM replica fetched none
    assert stats["inline_values_sent"] - stats_before["inline_values_sent"] >= media
    wait_for(lambda: _quiet(base_url), 60, "every request, KV block, reservation and channel to be released")
    # Serve's own bookkeeping references a few objects that come and go; a request that kept its
    # refs would add one per media item: ~250 here.
    try:
        wait_for(lambda: len(more_references(refs_before)) <= NUM_REQUESTS // 20, 60, "references")
    except AssertionError:
        more = more_references(refs_before)
        raise AssertionError(f"{len(more)} references more than at the baseline: {more[:10]}") from None
    try:
        wait_for(
            lambda: len({k for k in _referenced_objects() if k not in baseline}) <= NUM_REQUESTS // 20,
            60,
            "the referenced objects to return to their baseline",
        )
    except AssertionError:
        extra = {k: v for k, v in _referenced_objects().items() if k not in baseline}
        sample = "\n".join(sorted(extra.values())[:20])
        raise AssertionError(f"{len(extra)} objects more than at the baseline, e.g.\n{sample}") from None


def test_a_forwarded_repeat_reuses_its_prefix_and_what_cannot_be_forwarded_is_the_ingress_400(
    app: OpenAI,
) -> None:
    """The same image request twice, both forwarded: the same greedy answer, the second from the
    prefix cache; a request the replica cannot forward (max_tokens past the room the prompt leaves)
    is submitted by nobody and answered with the ingress's own 400, naming the parameter."""
    messages = _messages(5)
    first = app.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    again = app.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert first.choices[0].message.content == again.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as err:
        app.chat.completions.create(model=MODEL, messages=messages, max_tokens=4090, temperature=0)
    assert err.value.code == "max_tokens_too_large"
