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
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from openai import OpenAI

from tests.hf_oracle import hf_generate
from tests.integration.multinode import (
    Request,
    alive_actors,
    burst,
    hf_for_image,
    image_messages,
    multinode_app,
    running,
    wait_for,
    wanted,
)
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
    nodes = {role: (1, {f"{role}_node": 1}) for role in ("encoder", "prefill", "decode")}
    with multinode_app(tmp_path_factory, 1, nodes, app_config) as app:
        yield {**app, "dir": app["cache_dir"] / VL}


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
    assert r.choices[0].message.content == hf_for_image(cluster["dir"], png, MAX_TOKENS)


def _scales_alone(
    port: int, pool: str, next_request: Callable[[], Request], concurrency: int
) -> dict[Any, Any]:
    """Burst until ``pool`` runs 2 replicas; the other pools never want a second; no request fails;
    then the pool scales back to one. Returns the answers."""
    wait_for(lambda: all(wanted(p) == 1 and running(p) == 1 for p in POOLS), 90, "every pool at one replica")
    others = [p for p in POOLS if p != pool]
    seen: dict[str, int] = dict.fromkeys(others, 1)

    def scaled_up() -> bool:
        for p in others:
            seen[p] = max(seen[p], wanted(p))
        return running(pool) >= 2

    answers, up_s = asyncio.run(burst(port, VL, next_request, concurrency, scaled_up, max_s=150))
    failures = [a for a in answers.values() if isinstance(a, BaseException)]
    down_s = wait_for(lambda: wanted(pool) == 1, 90, f"{pool} to scale down")
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
        assert answers[png] == hf_for_image(cluster["dir"], png, MAX_TOKENS)


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
