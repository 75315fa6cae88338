"""What the e2e tests read of the running app: a Prometheus sample, the LLM replica's stats, the
encoder cache's books, and whether anything is still held."""

from __future__ import annotations

from typing import Any

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.e2e.common import MAX_TOKENS, PORT, VL, data_url, wait_for

LONG = 3500  # max_tokens of the generations a client abandons (ignore_eos: it would run to the end)
GENERATED = "ray_mmserve_generated_tokens_total"


def metric(app: dict[str, Any], sample: str, model: str) -> float:
    """One Prometheus sample summed over every worker exporting it, for one model (0 when absent)."""
    text = httpx.get(app["metrics_url"], timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == sample and s.labels.get("model") == model
    )


def llm_stats(model: str = VL) -> dict[str, Any]:
    from ray import serve

    handle = serve.get_deployment_handle(f"LLMServer-{model}", app_name="mmserve")
    return dict(handle.stats.remote().result(timeout_s=30))


def encoder_cache(model: str = VL) -> dict[str, Any]:
    return dict(httpx.get(f"http://127.0.0.1:{PORT}/stats").json()[model]["encoder_cache"])


def nothing_held() -> bool:
    """The LLM replica runs and queues nothing, every KV block is free, no encoder-cache entry is reserved."""
    s = llm_stats()
    return (
        s["num_running"] == 0
        and s["num_waiting"] == 0
        and s["num_free_blocks"] == s["num_total_blocks"]
        and encoder_cache()["reserved"] == 0
    )


def image_chat(png: bytes, text: str) -> list[dict[str, Any]]:
    content = [
        {"type": "image_url", "image_url": {"url": data_url(png, "image/png")}},
        {"type": "text", "text": text},
    ]
    return [{"role": "user", "content": content}]


def tokens_generated_since(client: OpenAI, app: dict[str, Any], before: float, seen: int = 0) -> float:
    """About how many tokens the VL replica streamed since ``before`` (a reading of its counter), for
    an upper bound. A short marker request goes last; the counter is read once it shows ``seen`` (the
    tokens the client saw) plus the marker's. Workers export once a second, so the figure is rough:
    good to tell a few dozen tokens from the thousands of a generation nobody stopped."""
    marker = client.chat.completions.create(
        model=VL,
        messages=[{"role": "user", "content": "marker"}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert marker.usage is not None and marker.usage.completion_tokens == MAX_TOKENS
    wait_for(
        lambda: metric(app, GENERATED, VL) >= before + seen + MAX_TOKENS,
        20.0,
        "the marker's tokens in /metrics",
    )
    return metric(app, GENERATED, VL) - before - MAX_TOKENS
