"""The Prometheus metrics Ray exports carry real values: known traffic shows in the counters and in
every stage's histogram, and ``/stats?pools=true`` shows each pool's own counters."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.e2e.app_readings import GENERATED, image_chat, llm_stats, metric
from tests.integration.e2e.common import AUDIO, MAX_TOKENS, PORT, VL, data_url, send_concurrently, wait_for
from tests.media import make_image_bytes
from tests.metric_names import EXPORTED, STAGES

pytestmark = pytest.mark.usefixtures("app")  # the package's one app (conftest.py)


def test_metrics_report_real_values(client: OpenAI, app: dict[str, Any]) -> None:
    """Known traffic (two fresh images, a streamed and a plain request) shows up in Ray's Prometheus
    export: generated tokens, encoded items, TTFT and e2e histogram counts, all for the VL model."""
    samples = (
        GENERATED,
        "ray_mmserve_encoder_items_total",
        "ray_mmserve_ttft_seconds_count",
        "ray_mmserve_e2e_latency_seconds_count",
    )
    before = {s: metric(app, s, VL) for s in samples}
    plain = client.chat.completions.create(
        model=VL,
        messages=image_chat(make_image_bytes(56, 56, seed=601), "Count."),
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    chunks = list(
        client.chat.completions.create(
            model=VL,
            messages=image_chat(make_image_bytes(84, 56, seed=602), "Count."),
            max_tokens=MAX_TOKENS + 3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert plain.usage is not None and chunks[-1].usage is not None
    completion = plain.usage.completion_tokens + chunks[-1].usage.completion_tokens
    assert completion == 2 * MAX_TOKENS + 3
    expected = dict(zip(samples, (completion, 2, 2, 2), strict=True))

    def exported() -> bool:
        return all(metric(app, s, VL) - before[s] >= n for s, n in expected.items())

    wait_for(exported, 20.0, f"{expected} more in {app['metrics_url']}")
    # Each model's encoder counts what the ingress dispatched to that model's pool (exports only lag):
    # no item is counted twice or under the other model's label.
    dispatched = httpx.get(f"http://127.0.0.1:{PORT}/stats").json()
    for model in (VL, AUDIO):
        assert (
            metric(app, "ray_mmserve_encoder_items_total", model)
            <= dispatched[model]["encoder_items_dispatched"]
        )


def _scrape(app: dict[str, Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the scrape, summed over the workers exporting it: (name, labels) -> value,
    the labels without Ray's own (worker, node, session)."""
    ray_labels = {"Component", "NodeAddress", "SessionName", "Version", "WorkerId", "deployment", "replica"}
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    text = httpx.get(app["metrics_url"], timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(
                sorted(
                    (k, v) for k, v in s.labels.items() if k not in ray_labels and not k.startswith("otel_")
                )
            )
            out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
    return out


def _stage_counts(
    scrape: dict[tuple[str, tuple[tuple[str, str], ...]], float], model: str
) -> dict[str, float]:
    """``pool/stage`` -> observations of ``ray_mmserve_stage_seconds`` for ``model``."""
    counts: dict[str, float] = {}
    for (name, labels), value in scrape.items():
        got = dict(labels)
        if name == "ray_mmserve_stage_seconds_count" and got.get("model") == model:
            counts[f"{got['pool']}/{got['stage']}"] = value
    return counts


def _sample(scrape: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in scrape.items() if n == name and labels.items() <= dict(ls).items())


def _families(scrape: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> set[str]:
    names = {n for n, _ in scrape}
    return names | {
        n.removesuffix(end) for n in names for end in ("_bucket", "_count", "_sum") if n.endswith(end)
    }


def _eventually(condition: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_every_stage_histogram_counts_the_requests_sent(
    client: OpenAI, app: dict[str, Any], media_server: str
) -> None:
    """Known traffic — a text request, a fresh inline image, the same image again (an encoder-cache
    hit), a fresh image by URL, a request for an unknown model — shows up in every per-stage
    histogram with exactly the observations those requests make; then pairs of concurrent requests
    for one fresh image make one of them wait for the other's encode (cache_wait)."""
    lookups = "ray_mmserve_encoder_cache_lookups_total"
    before = _scrape(app)
    stages0 = _stage_counts(before, VL)
    png = make_image_bytes(63, 49, seed=620)
    image = [{"type": "image_url", "image_url": {"url": data_url(png, "image/png")}}]
    by_url = [{"type": "image_url", "image_url": {"url": f"{media_server}/stages.png"}}]
    for content in ("Stages?", [*image, {"type": "text", "text": "Stages?"}], image, by_url):
        got = client.chat.completions.create(
            model=VL,
            messages=[{"role": "user", "content": content}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert got.usage is not None and got.usage.completion_tokens == MAX_TOKENS
    assert (
        httpx.post(
            f"http://127.0.0.1:{PORT}/v1/chat/completions",
            json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
        ).status_code
        == 404
    )
    # per pool/stage: what the four requests observe (sequential: each item alone in its encoder step)
    expected = {
        "ingress/prepare": 3,  # the media requests
        "ingress/cache_lookup": 2,  # the inline ones go through the hit path (the URL does not)
        "encoder/fetch": 1,  # the URL
        "encoder/cache_lookup": 2,  # the miss handed on by the hit path, and the URL
        "encoder/media_decode": 2,  # the two misses
        "encoder/preprocess": 2,
        "encoder/encoder_queue": 2,
        "encoder/encode": 2,
        "encoder/cache_wait": 0,
        "llm/llm_queue": 4,  # every request, once finished
        "llm/prefill": 4,
        "llm/decode": 4,
    }
    latency = (
        "ttft_seconds",
        "inter_token_latency_seconds",
        "time_per_output_token_seconds",
        "e2e_latency_seconds",
    )
    counts = {f"ray_mmserve_{n}_count": 4 for n in latency}
    answers = {("ingress", "miss"): 1, ("ingress", "hit"): 1, ("encoder", "miss"): 1, ("encoder", "hit"): 0}

    def delta(scrape: dict[Any, float]) -> dict[str, float]:
        stages = _stage_counts(scrape, VL)
        out = {k: stages.get(k, 0.0) - stages0.get(k, 0.0) for k in [*expected, "llm/engine_step"]}
        out.update({n: _sample(scrape, n, model=VL) - _sample(before, n, model=VL) for n in counts})
        for pool, result in answers:
            key = dict(model=VL, pool=pool, result=result)
            out[f"{pool}/{result}"] = _sample(scrape, lookups, **key) - _sample(before, lookups, **key)
        out["rejected"] = _sample(
            scrape, "ray_mmserve_requests_rejected_total", reason="model_not_found"
        ) - _sample(before, "ray_mmserve_requests_rejected_total", reason="model_not_found")
        return out

    want = {**expected, **counts, **{f"{p}/{r}": n for (p, r), n in answers.items()}, "rejected": 1}
    wait_for(
        lambda: all(delta(_scrape(app))[k] >= n for k, n in want.items()),
        20.0,
        f"{want} more in {app['metrics_url']}",
    )
    after = _scrape(app)
    got = delta(after)
    assert {k: got[k] for k in want} == want
    # one step per token of each request, each alone in the batch (no prefill is chunked here)
    assert got["llm/engine_step"] >= 4 * MAX_TOKENS
    missing = set(EXPORTED) - _families(after)
    assert not missing, f"not in the scrape: {sorted(missing)}"
    # each pool's step thread: CPU time and wall time, both counters of the same push, so the one
    # cannot pass the other (a thread's CPU time within a call is at most the call's wall time)
    for pool in ("encoder", "llm"):
        cpu = _sample(after, "ray_mmserve_step_cpu_seconds_total", model=VL, pool=pool)
        wall = _sample(after, "ray_mmserve_step_wall_seconds_total", model=VL, pool=pool)
        assert 0 < cpu <= wall, f"{pool}: step CPU {cpu} s, wall {wall} s"

    # cache_wait: two requests for one fresh image at once; the second's lookup finds the first's
    # reservation and waits for its encode (timing decides whether it does: up to three pairs)
    async def pair(seed: int) -> None:
        fresh = [
            {
                "type": "image_url",
                "image_url": {"url": data_url(make_image_bytes(49, 63, seed=seed), "image/png")},
            }
        ]

        async def send(c: Any, i: int) -> int:
            r = await c.chat.completions.create(
                model=VL, messages=[{"role": "user", "content": fresh}], max_tokens=2, temperature=0
            )
            return int(r.usage.completion_tokens) if r.usage else 0

        await send_concurrently(f"http://127.0.0.1:{PORT}/v1", send, [0, 1], 2)

    counted = _stage_counts(_scrape(app), VL)

    def grown(key: str) -> float:
        return _stage_counts(_scrape(app), VL).get(key, 0.0) - counted.get(key, 0.0)

    pairs = 0
    for seed in (630, 631, 632):
        asyncio.run(pair(seed))  # both answered: every observation of the pair is made
        pairs += 1
        if _eventually(lambda: grown("encoder/cache_wait") >= 1, 5.0):  # exported within a few ticks
            break
    wait_for(lambda: grown("encoder/encoder_queue") >= pairs, 20.0, "the pairs' encodes in the scrape")
    assert grown("encoder/cache_wait") == 1  # the pair that waited (one request of it), none before
    assert grown("encoder/encoder_queue") == pairs  # each pair's image encoded once
    every = {f"{pool}/{stage}" for pool, stage in STAGES}
    assert every == {*expected, "llm/engine_step"}  # the list the dashboard test reads is this test's
    assert every <= set(_stage_counts(_scrape(app), VL))


def test_stats_with_pools_shows_each_pools_own_counters(client: OpenAI) -> None:
    """``GET /stats?pools=true`` adds what the pools count themselves: each LLM replica this ingress
    reads from (by its id, and agreeing with that replica's own ``stats``) and the preparing replica's
    queue; a plain ``GET /stats`` stays as cheap as before (no pool calls)."""
    png = make_image_bytes(40, 32, seed=4242)
    content = [
        {"type": "image_url", "image_url": {"url": data_url(png, "image/png")}},
        {"type": "text", "text": "Pools?"},
    ]
    client.chat.completions.create(
        model=VL, messages=[{"role": "user", "content": content}], max_tokens=2, temperature=0
    )
    assert "pools" not in httpx.get(f"http://127.0.0.1:{PORT}/stats", timeout=30).json()[VL]
    pools = httpx.get(f"http://127.0.0.1:{PORT}/stats?pools=true", timeout=30).json()[VL]["pools"]
    own = llm_stats()  # the pool's one replica, asked directly
    assert pools["llm_replicas"][own["replica_id"]]["num_total_blocks"] == own["num_total_blocks"]
    assert own["link_channel_batches"] >= 1  # ``transport: auto``: the outputs came back on the link
    for rid, llm in pools["llm_replicas"].items():
        assert llm["replica_id"] == rid
    preparing = pools["preparing_replica"]
    assert "error" not in preparing, preparing
    assert preparing["queued_items"] >= 0 and preparing["processor_calls"] >= 1  # it processed the image
