"""The benchmark's client side: streamed chat requests through the real ``openai`` AsyncOpenAI client
at a fixed concurrency, and the server's own counters from ``GET /stats``."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, cast

import httpx
import openai

from cluster.bench.json_body import json_int, json_object
from cluster.bench.stats import RequestResult
from cluster.bench.workload import RequestSpec

if TYPE_CHECKING:
    from openai.types import CompletionUsage
    from openai.types.chat import ChatCompletionMessageParam


def make_client(base_url: str, timeout_s: float) -> openai.AsyncOpenAI:
    # trust_env=False: no proxy environment variable may divert a benchmark aimed at loopback.
    http = openai.DefaultAsyncHttpxClient(trust_env=False)
    return openai.AsyncOpenAI(
        base_url=base_url, api_key="unused", max_retries=0, timeout=timeout_s, http_client=http
    )


async def send_request(client: openai.AsyncOpenAI, spec: RequestSpec, max_tokens: int) -> RequestResult:
    """One streamed request; TTFT is taken at the first chunk that carries a choice, and the gaps
    between chunks that carry text are its inter-token latencies (``vllm bench serve``'s ITL)."""
    start = time.perf_counter()
    ttft: float | None = None
    usage: CompletionUsage | None = None
    chunks_with_text = 0
    text_at: list[float] = []
    try:
        stream = await client.chat.completions.create(
            model=spec.model,
            # mmserve's content parts (``uuid``, audio and video) are not in the OpenAI types
            messages=cast("list[ChatCompletionMessageParam]", spec.messages()),
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices:
                if ttft is None:
                    ttft = time.perf_counter() - start
                if chunk.choices[0].delta.content:
                    chunks_with_text += 1
                    text_at.append(time.perf_counter())
            if chunk.usage is not None:
                usage = chunk.usage
    except Exception as e:  # any failure is one failed request in the table, not the end of the run
        return RequestResult(spec.kind, ok=False, e2e_s=time.perf_counter() - start, error=_error_text(e))
    itls = tuple(b - a for a, b in itertools.pairwise(text_at))
    return _result(spec.kind, time.perf_counter() - start, ttft, usage, chunks_with_text, itls)


def _result(
    kind: str,
    e2e: float,
    ttft: float | None,
    usage: CompletionUsage | None,
    chunks_with_text: int,
    itls: tuple[float, ...] = (),
) -> RequestResult:
    if usage is None:  # a server that ignores include_usage: count text chunks instead
        return RequestResult(
            kind, ok=True, e2e_s=e2e, ttft_s=ttft, output_tokens=chunks_with_text, itls_s=itls
        )
    details = getattr(usage, "prompt_tokens_details", None)
    return RequestResult(
        kind,
        ok=True,
        e2e_s=e2e,
        ttft_s=ttft,
        output_tokens=usage.completion_tokens,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=(details.cached_tokens or 0) if details is not None else 0,
        itls_s=itls,
    )


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]


async def run_requests(
    client: openai.AsyncOpenAI,
    specs: Sequence[RequestSpec],
    concurrency: int,
    max_tokens: int,
    on_done: Callable[[], object] | None = None,
) -> tuple[list[RequestResult], float]:
    """All ``specs``, at most ``concurrency`` in flight, sent in order; returns results and wall time.
    ``on_done`` is called as each request ends (a progress bar's ``update``)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(spec: RequestSpec) -> RequestResult:
        async with sem:
            result = await send_request(client, spec, max_tokens)
        if on_done is not None:
            on_done()
        return result

    start = time.perf_counter()
    results = await asyncio.gather(*(one(s) for s in specs))
    return list(results), time.perf_counter() - start


def server_root(base_url: str) -> str:
    """``http://host:port/v1`` -> ``http://host:port`` (where ``/stats`` lives)."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


async def fetch_counters(base_url: str) -> dict[str, int] | None:
    """The server's encoder counters summed over its models; None when it has no mmserve ``/stats``."""
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
            resp = await http.get(server_root(base_url) + "/stats")
        if resp.status_code != 200:
            return None
        return flatten_stats(resp.json())
    except (httpx.HTTPError, ValueError):
        return None


def flatten_stats(body: Mapping[str, object]) -> dict[str, int]:
    """``{model: {"encoder_cache": {...}, "near_cache": {...}, "encoder_items_dispatched": n}}`` summed
    over models; a hit is one on the shared index or on the ingress's near cache (which the index
    never sees)."""
    totals = {
        "encoder_cache_hits": 0,
        "encoder_cache_misses": 0,
        "encoder_cache_evictions": 0,
        "encoder_items_dispatched": 0,
    }
    for body_of_model in body.values():
        model = json_object(body_of_model)
        cache = json_object(model.get("encoder_cache", {}))
        near = json_object(model.get("near_cache") or {})
        totals["encoder_cache_hits"] += json_int(cache.get("hits", 0)) + json_int(near.get("hits", 0))
        totals["encoder_cache_misses"] += json_int(cache.get("misses", 0))
        totals["encoder_cache_evictions"] += json_int(cache.get("evictions", 0))
        totals["encoder_items_dispatched"] += json_int(model.get("encoder_items_dispatched", 0))
    return totals
