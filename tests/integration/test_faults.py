"""Faults and overload on the real app (issue 12): replicas killed under load, a burst past capacity.

One app for the module (tiny Qwen2-VL, one replica per pool, admission bounded at 6 requests per
ingress), HTTP served directly on a loopback port, requests through httpx. Every answer that comes
back is checked against transformers' generate; every failure must be a clean 5xx or an SSE error
event naming its cause, within the timeout (a hang fails the test). Kills are real: ``ray.kill`` of
the Serve replica actor, which Serve then replaces.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from tests.hf_oracle import hf_generate
from tests.integration.local_app import free_port, own_ray, seed_tiny_models, shutdown_wait_loop
from tests.media import make_image_bytes

VL = "tiny-qwen2-vl"
MAX_TOKENS = 8
MAX_CONCURRENT = 6
TIMEOUT_S = 90.0  # a request still open after this is a hang


@dataclass
class Outcome:
    status: int  # HTTP status; 200 with ``error`` set is an in-band SSE error event
    text: str = ""
    error: str | None = None  # the error code the server named
    retry_after: str | None = None
    seconds: float = 0.0
    chunks: int = 0


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from cluster.config import AppConfig
    from cluster.serve_cli import start
    from cluster.serve_env import apply_serve_env

    cache_dir = tmp_path_factory.mktemp("models")
    port = free_port()
    one = {"num_replicas": 1, "num_cpus": 0.1}
    cfg = AppConfig.model_validate(
        {
            "port": port,
            "models_cache_dir": str(cache_dir),
            "ingress": {"http_mode": "direct", "admission": {"max_concurrent_requests": MAX_CONCURRENT}},
            "models": [
                {
                    "name": VL,
                    "tiny": "qwen2-vl",
                    "llm": {
                        "max_model_len": 2048,
                        "num_kv_blocks": 512,
                        "max_num_seqs": 2,
                        "deployment": one,
                    },
                    "encoder": {"deployment": one},
                }
            ],
        }
    )
    seed_tiny_models(cfg.model_dump())
    apply_serve_env()
    with own_ray():
        with shutdown_wait_loop():  # kills, not stops, are its tests: a quick teardown
            start(cfg)
        yield {"url": f"http://127.0.0.1:{port}", "dir": cache_dir / VL}


def _image_content(png: bytes, text: str) -> list[dict[str, Any]]:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]


def _expected(model_dir: Path, text: str, png: bytes | None = None, max_tokens: int = MAX_TOKENS) -> str:
    if png is None:
        return hf_generate(
            model_dir, [{"role": "user", "content": [{"type": "text", "text": text}]}], max_tokens
        )
    content = [{"type": "image"}, {"type": "text", "text": text}]
    image = Image.open(io.BytesIO(png)).convert("RGB")
    return hf_generate(model_dir, [{"role": "user", "content": content}], max_tokens, images=[image])


async def _send(
    http: httpx.AsyncClient, content: Any, max_tokens: int = MAX_TOKENS, on_chunk: Any = None
) -> Outcome:
    """One streamed request; classifies how it ended. ``on_chunk`` is called after each content chunk."""
    body = {
        "model": VL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    start = time.monotonic()
    out = Outcome(0)
    async with http.stream("POST", "/v1/chat/completions", json=body, timeout=TIMEOUT_S) as resp:
        out.status = resp.status_code
        out.retry_after = resp.headers.get("retry-after")
        if resp.status_code != 200:
            out.error = json.loads(await resp.aread())["error"]["code"]
        else:
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    out.error = data["error"]["code"]
                    break
                for choice in data.get("choices", []):
                    piece = choice["delta"].get("content") or ""
                    out.text += piece
                    if piece:
                        out.chunks += 1
                        if on_chunk is not None:
                            on_chunk()
    out.seconds = time.monotonic() - start
    return out


def _serve_replicas(deployment: str) -> list[str]:
    import ray

    prefix = f"SERVE_REPLICA::mmserve#{deployment}#"
    return [
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)
    ]


def _kill_replica(deployment: str) -> str:
    import ray

    (victim,) = _serve_replicas(deployment)
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    return victim


async def _wait_replaced(deployment: str, victim: str, timeout_s: float = 60.0) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        names = _serve_replicas(deployment)
        d = serve.status().applications["mmserve"].deployments[deployment]
        if victim not in names and len(names) == 1 and d.replica_states.get("RUNNING", 0) == 1:
            return
        assert time.monotonic() < deadline, f"Serve did not replace {victim} within {timeout_s}s"
        await asyncio.sleep(0.2)


async def _llm_stats_async() -> dict[str, Any]:
    from ray import serve

    return dict(await serve.get_deployment_handle(f"LLMServer-{VL}", app_name="mmserve").stats.remote())


def _llm_stats() -> dict[str, Any]:
    from ray import serve

    return dict(
        serve.get_deployment_handle(f"LLMServer-{VL}", app_name="mmserve").stats.remote().result(timeout_s=30)
    )


async def _encoder_stats() -> dict[str, Any]:
    from ray import serve

    handle = serve.get_deployment_handle(f"EncoderServer-{VL}", app_name="mmserve")
    return dict(await handle.stats.remote())


def _assert_clean_failure(o: Outcome) -> None:
    """A failure names its cause: a 5xx JSON error with Retry-After, or an SSE error event."""
    assert o.error is not None, o
    if o.status != 200:
        assert 500 <= o.status < 600 and o.retry_after is not None, o


def test_llm_replica_killed_mid_generation(app: dict[str, Any]) -> None:
    """Two streams run on the LLM replica (max_num_seqs 2) and a third request waits in its queue when
    it is killed: the streams end with an error event (no hang); the waiting one, which got nothing
    yet, is submitted again to the successor and equals HF, as do requests sent as it dies."""
    prompts = ["Tell a long story.", "Tell another long story."]
    queued, late = "Which one waited?", ["What comes next?", "Count to three."]
    expected_queued = _expected(app["dir"], queued)
    expected_late = [_expected(app["dir"], t) for t in late]

    async def scenario() -> tuple[list[Outcome], Outcome, list[Outcome]]:
        async with httpx.AsyncClient(base_url=app["url"]) as http:
            streaming = asyncio.Event()
            seen: set[int] = set()

            def started(i: int) -> Any:
                def bump() -> None:
                    seen.add(i)
                    if len(seen) == len(prompts):
                        streaming.set()

                return bump

            long_ones = [
                asyncio.create_task(_send(http, p, max_tokens=1500, on_chunk=started(i)))
                for i, p in enumerate(prompts)
            ]
            await asyncio.wait_for(streaming.wait(), TIMEOUT_S)
            waiting = asyncio.create_task(_send(http, queued))
            deadline = time.monotonic() + TIMEOUT_S
            while (await _llm_stats_async())["num_waiting"] < 1:
                assert time.monotonic() < deadline and not waiting.done(), "the third request never queued"
                await asyncio.sleep(0.05)
            victim = _kill_replica(f"LLMServer-{VL}")
            after = [asyncio.create_task(_send(http, t)) for t in late]
            killed = list(await asyncio.gather(*long_ones))
            rerouted = list(await asyncio.gather(*after))
            await _wait_replaced(f"LLMServer-{VL}", victim)
            return killed, await waiting, rerouted

    killed, waited, rerouted = asyncio.run(scenario())
    for o in killed:  # in flight on the dead replica: a clean error event after some tokens
        assert o.status == 200 and o.chunks >= 1 and o.error == "llm_replica_lost", o
    assert (waited.status, waited.error, waited.text) == (200, None, expected_queued), waited
    assert [o.text for o in rerouted] == expected_late, rerouted


def test_encoder_replica_killed_under_load(app: dict[str, Any]) -> None:
    """Kill the encoder replica while its FIFO holds items: they are encoded again by its successor
    and every request equals HF."""
    pngs = [make_image_bytes(448, 448, seed=1200 + i) for i in range(6)]
    text = "What is this?"
    expected = [_expected(app["dir"], text, png) for png in pngs]

    async def scenario() -> tuple[list[Outcome], bool]:
        async with httpx.AsyncClient(base_url=app["url"]) as http:
            tasks = [asyncio.create_task(_send(http, _image_content(png, text))) for png in pngs]
            queued = False
            deadline = time.monotonic() + 30
            while not queued and time.monotonic() < deadline and not all(t.done() for t in tasks):
                queued = (await _encoder_stats())["queued_items"] > 0
            victim = _kill_replica(f"EncoderServer-{VL}")
            outcomes = list(await asyncio.gather(*tasks))
            await _wait_replaced(f"EncoderServer-{VL}", victim)
            return outcomes, queued

    outcomes, queued = asyncio.run(scenario())
    print(f"encoder killed with items queued: {queued}")
    assert [(o.status, o.error) for o in outcomes] == [(200, None)] * len(pngs), outcomes
    assert [o.text for o in outcomes] == expected


def test_cache_index_shard_killed_under_load(app: dict[str, Any]) -> None:
    """Kill a cache-index shard (Ray restarts it, empty) under image load: every request equals HF
    or fails cleanly, and the same images afterwards equal HF (their entries are misses now)."""
    import ray

    pngs = [make_image_bytes(320, 240, seed=1400 + i) for i in range(4)]
    text = "And this?"
    expected = {png: _expected(app["dir"], text, png) for png in pngs}

    async def scenario() -> tuple[list[Outcome], list[Outcome]]:
        async with httpx.AsyncClient(base_url=app["url"]) as http:
            tasks = [asyncio.create_task(_send(http, _image_content(png, text))) for png in pngs]
            await asyncio.sleep(0.3)
            ray.kill(ray.get_actor(f"mmserve-encoder-cache-{VL}-0", namespace="mmserve"), no_restart=False)
            outcomes = list(await asyncio.gather(*tasks))
            again = [await _send(http, _image_content(png, text)) for png in pngs]
            return outcomes, again

    outcomes, again = asyncio.run(scenario())
    print("cache shard kill:", [(o.status, o.error) for o in outcomes])
    for png, o in zip(pngs, outcomes, strict=True):
        if o.error is None:
            assert o.text == expected[png]
        else:
            _assert_clean_failure(o)
    assert [o.text for o in again] == [expected[png] for png in pngs]


def test_burst_past_capacity_gets_fast_503s_and_the_accepted_complete(app: dict[str, Any]) -> None:
    """40 requests at once against 6 admitted per ingress: the excess is refused with 503 and
    Retry-After, most of it before any accepted one finishes; every accepted one equals HF; afterwards nothing
    is queued and a request is served as before."""
    text = "Say something."
    expected = _expected(app["dir"], text, max_tokens=64)

    async def scenario() -> tuple[Outcome, list[Outcome], Outcome]:
        async with httpx.AsyncClient(base_url=app["url"], limits=httpx.Limits(max_connections=100)) as http:
            before = await _send(http, text, max_tokens=64)
            burst = list(await asyncio.gather(*(_send(http, text, max_tokens=64) for _ in range(40))))
            return before, burst, await _send(http, text, max_tokens=64)

    before, burst, after = asyncio.run(scenario())
    refused = [o for o in burst if o.status == 503]
    accepted = [o for o in burst if o.status != 503]
    print(
        f"burst: {len(refused)} refused (slowest {max(o.seconds for o in refused) * 1000:.0f} ms), "
        f"{len(accepted)} accepted (fastest {min(o.seconds for o in accepted):.2f} s); "
        f"latency before {before.seconds:.2f} s, after {after.seconds:.2f} s"
    )
    assert len(refused) >= 40 - 3 * MAX_CONCURRENT
    assert all(o.error == "overloaded" and o.retry_after == "1" for o in refused)
    assert all(o.status == 200 and o.error is None and o.text == expected for o in accepted)
    refusal_p50 = sorted(o.seconds for o in refused)[len(refused) // 2]
    assert refusal_p50 < min(o.seconds for o in accepted)  # shed, not queued behind the accepted
    assert (before.status, after.status) == (200, 200) and before.text == after.text == expected
    s = _llm_stats()
    assert s["num_waiting"] == 0 and s["num_running"] == 0


def test_nothing_is_held_after_the_faults(app: dict[str, Any]) -> None:
    """After every fault above: no running or waiting request, every KV block free, no encoder-cache
    reservation left (a dead holder's reservations expire), no output channel open for long."""
    import ray

    from cluster.cache_shards import cache_index_args, open_cache_index
    from cluster.config import ModelConfig

    cache = open_cache_index(*cache_index_args(ModelConfig(name=VL, tiny="qwen2-vl")))
    deadline = time.monotonic() + 60
    while True:
        s = _llm_stats()
        reserved = asyncio.run(cache.stats())["reserved"]
        if (s["num_running"], s["num_waiting"], reserved) == (0, 0, 0) and s["num_free_blocks"] == s[
            "num_total_blocks"
        ]:
            break
        assert time.monotonic() < deadline, (s, reserved)
        time.sleep(0.5)
    assert ray.is_initialized()
