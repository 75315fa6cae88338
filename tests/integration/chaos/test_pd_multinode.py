"""E/P/D on a four-node Ray cluster on this machine: encoder, prefill and decode pools each on its own node.

  head     (CPU 1)                    Serve controller, IngressServer, cache index
  encoder  (CPU 1, encoder_node)      EncoderServer replicas
  prefill  (CPU 1, prefill_node)      LLMPrefillServer replicas
  decode   (CPU 1, decode_node)       LLMDecodeServer replicas

Nodes are separate raylets with separate object stores (``ray.cluster_utils.Cluster``): embeddings cross
from the encoder node to the prefill node through Ray's object transfer, the KV from the prefill node
to the decode node over the replicas' direct link. The GCS actor table shows where each replica ran;
answers equal HF generate. Then three bursts, each scaling its own pool 1 -> 2 on its own signal and
leaving the other two at one replica, with no failed request:

  image burst            (distinct images)          encoder pool, ``EncoderQueuePolicy``
  long-prompt burst      (distinct ~1,500-token prompts, 2 tokens out)  prefill pool, ``PrefillQueuePolicy``
  long-generation burst  (short prompts, 160 tokens out, c=48)          decode pool, ``LLMLoadPolicy``

The targets are low and the windows short so each burst takes under a minute here; the prefill pool's
engine takes 64-token steps (``max_num_batched_tokens``), so a long prompt is several steps and a
backlog builds on the one replica. In the chaos tier: minutes on a small machine.
"""

from __future__ import annotations

import asyncio
import base64
import io
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from openai import AsyncOpenAI, OpenAI
from PIL import Image

from tests.hf_oracle import hf_generate
from tests.integration.local_app import free_port, own_ray
from tests.media import make_image_bytes

pytestmark = pytest.mark.chaos

MAX_TOKENS = 6
VL = "tiny-qwen2-vl"
ENC, PREFILL, DECODE = f"EncoderServer-{VL}", f"LLMPrefillServer-{VL}", f"LLMDecodeServer-{VL}"
POOLS = (ENC, PREFILL, DECODE)
FAST = {
    "upscale_delay_s": 1.0,
    "downscale_delay_s": 4.0,
    "look_back_period_s": 2.0,
    "metrics_interval_s": 0.5,
}


def _pool(marker: str, policy: str, kwargs: dict[str, float]) -> dict[str, Any]:
    return {
        "num_cpus": 0.2,
        "resources": {marker: 0.01},
        "autoscaling": {
            "min_replicas": 1,
            "max_replicas": 2,
            **FAST,
            "policy": {"policy_function": f"cluster.autoscaling_policy:{policy}", "policy_kwargs": kwargs},
        },
    }


def app_config(port: int, cache_dir: str) -> dict[str, Any]:
    encoder = _pool(
        "encoder_node",
        "EncoderQueuePolicy",
        {"target_queued_embeddings_per_replica": 64, "embeddings_per_handle_queued_request": 64},
    )
    encoder["max_ongoing_requests"] = 4
    prefill = _pool(
        "prefill_node",
        "PrefillQueuePolicy",
        {"target_queued_prompt_tokens_per_replica": 3000, "prompt_tokens_per_handle_queued_request": 64},
    )
    decode = _pool("decode_node", "LLMLoadPolicy", {"target_kv_usage": 0.9, "target_ongoing_requests": 16})
    return {
        "port": port,
        "models_cache_dir": cache_dir,
        "models": [
            {
                "name": VL,
                "tiny": "qwen2-vl",
                "encoder": {
                    "device": "cpu",
                    "max_num_encoder_input_tokens": 2048,
                    "encoder_cache_size": 16384,
                    "deployment": encoder,
                },
                "llm": {
                    "device": "cpu",
                    "num_kv_blocks": 4096,
                    "max_num_batched_tokens": 64,
                    "pools": [
                        {"role": "prefill", "deployment": prefill},
                        {"role": "decode", "deployment": decode},
                    ],
                },
            }
        ],
        "ingress": {"deployment": {"num_replicas": 1, "num_cpus": 0.1}},
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from cluster.bench.chaos_node import start_head
    from cluster.config import AppConfig
    from cluster.serve_cli import start

    c = start_head({"num_cpus": 1, "include_dashboard": False})  # tried again if a busy host times it out
    try:
        nodes = {
            role: c.add_node(num_cpus=1, resources={f"{role}_node": 1}).node_id
            for role in ("encoder", "prefill", "decode")
        }
        c.wait_for_nodes()
        with own_ray(c.address):
            port = free_port()
            cache_dir = tmp_path_factory.mktemp("models")
            start(AppConfig.model_validate(app_config(port, str(cache_dir))))
            yield {"nodes": {"head": c.head_node.node_id, **nodes}, "dir": cache_dir / VL, "port": port}
    finally:
        c.shutdown()


def alive_actors(class_suffix: str) -> list[dict[str, Any]]:
    """Live actors whose class name ends with ``class_suffix``, from the GCS actor table."""
    import ray

    table = ray._private.state.actors()  # the GCS view; the state API would need the dashboard
    return [a for a in table.values() if a["State"] == "ALIVE" and a["ActorClassName"].endswith(class_suffix)]


def states(deployment: str) -> dict[str, int]:
    from ray import serve

    d = serve.status().applications["mmserve"].deployments[deployment]
    return {str(getattr(s, "value", s)): int(n) for s, n in d.replica_states.items()}


def running(deployment: str) -> int:
    return states(deployment).get("RUNNING", 0)


def wanted(deployment: str) -> int:
    """Replicas starting or running (not stopping): what the pool has grown to."""
    return sum(n for s, n in states(deployment).items() if s not in ("STOPPING", "STOPPED"))


def image_messages(png: bytes, text: str = "Describe.") -> list[dict[str, Any]]:
    url = f"data:image/png;base64,{base64.b64encode(png).decode()}"
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def hf_for_image(model_dir: Any, png: bytes, text: str = "Describe.") -> str:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    return hf_generate(model_dir, messages, MAX_TOKENS, images=[Image.open(io.BytesIO(png)).convert("RGB")])


def test_pools_run_on_their_own_nodes_and_answer_as_hf(cluster: dict[str, Any]) -> None:
    nodes = cluster["nodes"]
    placed = {name: {a["Address"]["NodeID"] for a in alive_actors(f":{name}")} for name in POOLS}
    assert placed == {ENC: {nodes["encoder"]}, PREFILL: {nodes["prefill"]}, DECODE: {nodes["decode"]}}
    assert len({nodes["encoder"], nodes["prefill"], nodes["decode"], nodes["head"]}) == 4

    client = OpenAI(
        base_url=f"http://127.0.0.1:{cluster['port']}/v1", api_key="-", timeout=120, max_retries=0
    )
    text = [{"role": "user", "content": "Tell me about the weather."}]
    r = client.chat.completions.create(model=VL, messages=text, max_tokens=MAX_TOKENS, temperature=0)  # type: ignore[arg-type]
    assert r.choices[0].message.content == hf_generate(cluster["dir"], text, MAX_TOKENS)
    png = make_image_bytes(84, 56, seed=11)
    r = client.chat.completions.create(
        model=VL,
        messages=image_messages(png),  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert r.choices[0].message.content == hf_for_image(cluster["dir"], png)


Request = tuple[Any, list[dict[str, Any]], int]  # (key, messages, max_tokens)


async def _burst(
    port: int, next_request: Callable[[], Request], concurrency: int, until: Callable[[], bool], max_s: float
) -> tuple[dict[Any, Any], float | None]:
    """Keep ``concurrency`` fresh requests in flight until ``until()`` holds (or ``max_s`` passes), then
    let them finish. Returns each answer (or exception) by key, and the seconds until ``until()`` held."""
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", timeout=180, max_retries=0)
    start = time.monotonic()
    reached: list[float] = []
    answers: dict[Any, Any] = {}

    async def worker() -> None:
        while not reached and time.monotonic() - start < max_s:
            key, messages, max_tokens = next_request()
            try:
                r = await client.chat.completions.create(
                    model=VL,
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=max_tokens,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                answers[key] = r.choices[0].message.content or ""
            except Exception as e:  # recorded, asserted on by the test
                answers[key] = e

    async def watch() -> None:
        while not reached and time.monotonic() - start < max_s:
            if await asyncio.to_thread(until):
                reached.append(time.monotonic() - start)
            await asyncio.sleep(0.25)

    await asyncio.gather(watch(), *(worker() for _ in range(concurrency)))
    await client.close()
    return answers, (reached[0] if reached else None)


def _wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.25)
    return time.monotonic() - start


def _scales_alone(
    port: int, pool: str, next_request: Callable[[], Request], concurrency: int
) -> dict[Any, Any]:
    """Burst until ``pool`` runs 2 replicas; the other pools never want a second; no request fails;
    then the pool scales back to one. Returns the answers."""
    _wait_for(lambda: all(wanted(p) == 1 and running(p) == 1 for p in POOLS), 90, "every pool at one replica")
    others = [p for p in POOLS if p != pool]
    seen: dict[str, int] = dict.fromkeys(others, 1)

    def scaled_up() -> bool:
        for p in others:
            seen[p] = max(seen[p], wanted(p))
        return running(pool) >= 2

    answers, up_s = asyncio.run(_burst(port, next_request, concurrency, scaled_up, max_s=150))
    failures = [a for a in answers.values() if isinstance(a, BaseException)]
    down_s = _wait_for(lambda: wanted(pool) == 1, 90, f"{pool} to scale down")
    print(
        f"\n{pool}: 1 -> 2 replicas {up_s} s into the burst ({len(answers)} requests), 2 -> 1 {down_s:.1f} s after"
    )
    assert not failures, failures[:3]
    assert up_s is not None, f"{pool} never reached 2 replicas during the burst"
    assert seen == dict.fromkeys(others, 1), seen  # the other pools never wanted a second replica
    return answers


def test_image_burst_scales_the_encoder_pool_alone(cluster: dict[str, Any]) -> None:
    seeds = iter(range(1000, 100000))

    def next_image() -> Request:
        png = make_image_bytes(224, 224, seed=next(seeds))
        return png, image_messages(png), MAX_TOKENS

    answers = _scales_alone(cluster["port"], ENC, next_image, 16)
    images = list(answers)
    for png in images[:: max(1, len(images) // 4)]:
        assert answers[png] == hf_for_image(cluster["dir"], png)


def test_long_prompt_burst_scales_the_prefill_pool_alone(cluster: dict[str, Any]) -> None:
    words = ["river", "stone", "cloud", "lamp", "orange", "garden", "window", "violin", "paper", "engine"]
    counter = iter(range(100000))

    def next_prompt() -> Request:
        i = next(counter)
        rng = random.Random(i)
        text = f"Document {i}. " + " ".join(rng.choice(words) for _ in range(450)) + " Summarize."
        return text, [{"role": "user", "content": text}], 2

    answers = _scales_alone(cluster["port"], PREFILL, next_prompt, 16)
    for text in list(answers)[:2]:  # distinct long prompts, each its own KV moved to the decode node
        assert answers[text] == hf_generate(cluster["dir"], [{"role": "user", "content": text}], 2)


def test_long_generation_burst_scales_the_decode_pool_alone(cluster: dict[str, Any]) -> None:
    prompts = (f"Story number {i}, tell it long." for i in range(100000))

    def next_story() -> Request:
        p = next(prompts)
        return p, [{"role": "user", "content": p}], 160

    _scales_alone(cluster["port"], DECODE, next_story, 48)
