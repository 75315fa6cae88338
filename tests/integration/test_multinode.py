"""The app on a three-node Ray cluster on this machine: encoder pool on one node, LLM pool on another.

  head       (CPU 1)                    Serve controller, HTTP proxy, IngressServer, cache index
  encoder    (CPU 2, encoder_node)      EncoderServer replicas, each a TP-2 group in its placement group
  llm        (CPU 2, llm_node)          LLMServer replicas

Nodes are separate raylets with separate object stores (``ray.cluster_utils.Cluster``), so embeddings
cross from the encoder node to the LLM node through Ray's object transfer, as on a real cluster.
Answers are checked against HF generate (the single-node e2e test checks the same oracle), and the
autoscaling test drives an image burst through the pools' own policies (cluster/autoscaling_policy.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
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

MAX_TOKENS = 6
VL = "tiny-qwen2-vl"
ENC, LLM = f"EncoderServer-{VL}", f"LLMServer-{VL}"


def app_config(port: int, cache_dir: str) -> dict[str, Any]:
    fast = {
        "upscale_delay_s": 1.0,
        "downscale_delay_s": 4.0,
        "look_back_period_s": 2.0,
        "metrics_interval_s": 0.5,
    }
    return {
        "port": port,
        "models_cache_dir": cache_dir,
        "models": [
            {
                "name": VL,
                "tiny": "qwen2-vl",
                "encoder": {
                    "device": "cpu",
                    "mm_encoder_tp_size": 2,
                    "mm_encoder_tp_mode": "data",
                    "deployment": {
                        "num_cpus": 0.2,
                        "resources": {"encoder_node": 0.01},
                        "max_ongoing_requests": 4,
                        "autoscaling": {
                            "min_replicas": 1,
                            "max_replicas": 2,
                            **fast,
                            "policy": {
                                "policy_function": "cluster.autoscaling_policy:EncoderQueuePolicy",
                                "policy_kwargs": {
                                    "target_queued_embeddings_per_replica": 64,
                                    "embeddings_per_handle_queued_request": 64,
                                },
                            },
                        },
                    },
                },
                "llm": {
                    "device": "cpu",
                    "num_kv_blocks": 512,
                    "deployment": {
                        "num_cpus": 0.2,
                        "resources": {"llm_node": 0.01},
                        "autoscaling": {
                            "min_replicas": 1,
                            "max_replicas": 2,
                            **fast,
                            "policy": {
                                "policy_function": "cluster.autoscaling_policy:LLMLoadPolicy",
                                "policy_kwargs": {"target_ongoing_requests": 32},
                            },
                        },
                    },
                },
            }
        ],
        "ingress": {"deployment": {"num_replicas": 1, "num_cpus": 0.1}},
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    nodes = {"encoder": (2, {"encoder_node": 1}), "llm": (2, {"llm_node": 1})}
    with multinode_app(tmp_path_factory, 1, nodes, app_config) as app:
        yield {**app, "dir": app["cache_dir"] / VL}


@pytest.fixture(scope="module")
def client(cluster: dict[str, Any]) -> OpenAI:
    return OpenAI(
        base_url=f"http://127.0.0.1:{cluster['port']}/v1", api_key="unused", timeout=120, max_retries=0
    )


def expected_for_image(model_dir: Any, png: bytes) -> str:
    return hf_for_image(model_dir, png, MAX_TOKENS)


def test_pools_run_on_their_own_nodes(cluster: dict[str, Any]) -> None:
    nodes = cluster["nodes"]
    placed = {
        name: {a["Address"]["NodeID"] for a in alive_actors(name)}
        for name in (f":{ENC}", f":{LLM}", "EncoderRankWorker")
    }
    assert placed == {
        f":{ENC}": {nodes["encoder"]},
        f":{LLM}": {nodes["llm"]},
        "EncoderRankWorker": {nodes["encoder"]},  # the TP group's bundles carry encoder_node too
    }
    assert len(alive_actors("EncoderRankWorker")) == 2  # one TP-2 group
    # ...inside the replica's own placement group (Serve's placement_group_bundles), not a second one:
    # bundle 0 the replica, one bundle per rank, all on the encoder node.
    import ray

    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    assert len(groups) == 1, groups
    assert len(groups[0]["bundles"]) == 3
    assert set(groups[0]["bundles_to_node_id"].values()) == {nodes["encoder"]}


def test_answers_equal_hf_across_nodes(client: OpenAI, cluster: dict[str, Any]) -> None:
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
    assert r.choices[0].message.content == expected_for_image(cluster["dir"], png)
    stats = httpx.get(f"http://127.0.0.1:{cluster['port']}/stats").json()[VL]
    assert stats["encoder_items_dispatched"] == 1


def test_image_burst_scales_encoder_pool_only(client: OpenAI, cluster: dict[str, Any]) -> None:
    assert (running(ENC), running(LLM)) == (1, 1)
    llm_counts: list[int] = []

    def encoder_scaled_up() -> bool:
        llm_counts.append(wanted(LLM))
        return running(ENC) >= 2

    seeds = iter(range(1000, 100000))

    def next_image() -> Request:
        png = make_image_bytes(224, 224, seed=next(seeds))
        return png, image_messages(png), MAX_TOKENS

    answers, scale_up_s = asyncio.run(
        burst(cluster["port"], VL, next_image, 16, encoder_scaled_up, max_s=120)
    )
    print(f"\nencoder pool 1 -> 2 replicas {scale_up_s} s after the burst started; {len(answers)} requests")
    failures = [a for a in answers.values() if isinstance(a, BaseException)]
    assert not failures, failures[:3]
    assert scale_up_s is not None, "the encoder pool never reached 2 replicas during the burst"
    assert max(llm_counts) == 1 and running(LLM) == 1
    images = list(answers)
    for png in images[:: max(1, len(images) // 6)]:
        assert answers[png] == expected_for_image(cluster["dir"], png)

    # After the burst: back to one replica; requests keep working during and after the change.
    down_s = wait_for(lambda: running(ENC) == 1, 60, "the encoder pool to scale down")
    print(f"encoder pool 2 -> 1 replicas {down_s:.1f} s after the burst ended")
    assert running(LLM) == 1
    for png in images[:2]:  # computed before or during the scale-down: cache hit or recompute
        r = client.chat.completions.create(
            model=VL,
            messages=image_messages(png),  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        assert r.choices[0].message.content == expected_for_image(cluster["dir"], png)


def test_long_generations_scale_llm_pool_only(cluster: dict[str, Any]) -> None:
    assert (running(ENC), running(LLM)) == (1, 1)
    encoder_counts: list[int] = []

    def llm_scaled_up() -> bool:
        encoder_counts.append(wanted(ENC))
        return running(LLM) >= 2

    prompts = (f"Story number {i}, tell it long." for i in range(100000))

    def next_text() -> Request:
        p = next(prompts)
        return p, [{"role": "user", "content": p}], 192

    answers, scale_up_s = asyncio.run(burst(cluster["port"], VL, next_text, 48, llm_scaled_up, max_s=120))
    print(f"\nLLM pool 1 -> 2 replicas {scale_up_s} s after the burst started; {len(answers)} requests")
    failures = [a for a in answers.values() if isinstance(a, BaseException)]
    assert not failures, failures[:3]
    assert scale_up_s is not None, "the LLM pool never reached 2 replicas during the burst"
    assert max(encoder_counts) == 1 and running(ENC) == 1
    down_s = wait_for(lambda: running(LLM) == 1, 60, "the LLM pool to scale down")
    print(f"LLM pool 2 -> 1 replicas {down_s:.1f} s after the burst ended")
