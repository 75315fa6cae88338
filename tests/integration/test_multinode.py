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
import base64
import io
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI
from PIL import Image

from tests.hf_oracle import hf_generate
from tests.integration.local_app import own_ray
from tests.media import make_image_bytes

PORT = 8432
MAX_TOKENS = 6
VL = "tiny-qwen2-vl"
ENC, LLM = f"EncoderServer-{VL}", f"LLMServer-{VL}"


def app_config(cache_dir: str) -> dict[str, Any]:
    fast = {
        "upscale_delay_s": 1.0,
        "downscale_delay_s": 4.0,
        "look_back_period_s": 2.0,
        "metrics_interval_s": 0.5,
    }
    return {
        "port": PORT,
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
    from ray.cluster_utils import Cluster

    from cluster.config import AppConfig
    from cluster.serve_cli import start

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        enc = c.add_node(num_cpus=2, resources={"encoder_node": 1})
        llm = c.add_node(num_cpus=2, resources={"llm_node": 1})
        c.wait_for_nodes()
        with own_ray(c.address):
            cache_dir = tmp_path_factory.mktemp("models")
            start(AppConfig.model_validate(app_config(str(cache_dir))))
            yield {
                "nodes": {"head": c.head_node.node_id, "encoder": enc.node_id, "llm": llm.node_id},
                "dir": cache_dir / VL,
            }
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def client(cluster: dict[str, Any]) -> OpenAI:
    return OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", timeout=120, max_retries=0)


def alive_actors(class_suffix: str) -> list[dict[str, Any]]:
    """Live actors whose class name ends with ``class_suffix``, from the GCS actor table."""
    import ray

    table = ray._private.state.actors()  # the GCS view; the state API would need the dashboard
    return [a for a in table.values() if a["State"] == "ALIVE" and a["ActorClassName"].endswith(class_suffix)]


def wanted_replicas(deployment: str) -> int:
    """Replicas starting or running (not those stopping): what the pool has grown to."""
    from ray import serve

    states = serve.status().applications["mmserve"].deployments[deployment].replica_states
    return sum(int(n) for s, n in states.items() if getattr(s, "value", s) not in ("STOPPING", "STOPPED"))


def running_replicas(deployment: str) -> int:
    from ray import serve

    status = serve.status().applications["mmserve"].deployments[deployment]
    return int(status.replica_states.get("RUNNING", 0))


def image_request(png: bytes, text: str = "Describe.") -> list[dict[str, Any]]:
    url = f"data:image/png;base64,{base64.b64encode(png).decode()}"
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}],
        }
    ]


def expected_for_image(model_dir: Any, png: bytes, text: str = "Describe.") -> str:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    image = Image.open(io.BytesIO(png)).convert("RGB")
    return hf_generate(model_dir, messages, MAX_TOKENS, images=[image])


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
        messages=image_request(png),  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert r.choices[0].message.content == expected_for_image(cluster["dir"], png)
    stats = httpx.get(f"http://127.0.0.1:{PORT}/stats").json()[VL]
    assert stats["encoder_items_dispatched"] == 1


Request = tuple[Any, list[dict[str, Any]], int]  # (key, messages, max_tokens)


async def _burst(
    next_request: Callable[[], Request], concurrency: int, until: Callable[[], bool], max_s: float
) -> tuple[dict[Any, Any], float | None]:
    """Keep ``concurrency`` fresh requests in flight until ``until()`` holds (or ``max_s`` passes),
    then let them finish. Returns each request's answer (or exception) by key, and the seconds from
    the first request to when ``until()`` first held (None if it never did)."""
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", timeout=120, max_retries=0)
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


def wait_for(cond: Any, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.25)
    return time.monotonic() - start


def test_image_burst_scales_encoder_pool_only(client: OpenAI, cluster: dict[str, Any]) -> None:
    assert (running_replicas(ENC), running_replicas(LLM)) == (1, 1)
    llm_counts: list[int] = []

    def encoder_scaled_up() -> bool:
        llm_counts.append(wanted_replicas(LLM))
        return running_replicas(ENC) >= 2

    seeds = iter(range(1000, 100000))

    def next_image() -> Request:
        png = make_image_bytes(224, 224, seed=next(seeds))
        return png, image_request(png), MAX_TOKENS

    answers, scale_up_s = asyncio.run(_burst(next_image, 16, encoder_scaled_up, max_s=120))
    print(f"\nencoder pool 1 -> 2 replicas {scale_up_s} s after the burst started; {len(answers)} requests")
    failures = [a for a in answers.values() if isinstance(a, BaseException)]
    assert not failures, failures[:3]
    assert scale_up_s is not None, "the encoder pool never reached 2 replicas during the burst"
    assert max(llm_counts) == 1 and running_replicas(LLM) == 1
    images = list(answers)
    for png in images[:: max(1, len(images) // 6)]:
        assert answers[png] == expected_for_image(cluster["dir"], png)

    # After the burst: back to one replica; requests keep working during and after the change.
    down_s = wait_for(lambda: running_replicas(ENC) == 1, 60, "the encoder pool to scale down")
    print(f"encoder pool 2 -> 1 replicas {down_s:.1f} s after the burst ended")
    assert running_replicas(LLM) == 1
    for png in images[:2]:  # computed before or during the scale-down: cache hit or recompute
        r = client.chat.completions.create(
            model=VL,
            messages=image_request(png),  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        assert r.choices[0].message.content == expected_for_image(cluster["dir"], png)


def test_long_generations_scale_llm_pool_only(cluster: dict[str, Any]) -> None:
    assert (running_replicas(ENC), running_replicas(LLM)) == (1, 1)
    encoder_counts: list[int] = []

    def llm_scaled_up() -> bool:
        encoder_counts.append(wanted_replicas(ENC))
        return running_replicas(LLM) >= 2

    prompts = (f"Story number {i}, tell it long." for i in range(100000))

    def next_text() -> Request:
        p = next(prompts)
        return p, [{"role": "user", "content": p}], 192

    answers, scale_up_s = asyncio.run(_burst(next_text, 48, llm_scaled_up, max_s=120))
    print(f"\nLLM pool 1 -> 2 replicas {scale_up_s} s after the burst started; {len(answers)} requests")
    failures = [a for a in answers.values() if isinstance(a, BaseException)]
    assert not failures, failures[:3]
    assert scale_up_s is not None, "the LLM pool never reached 2 replicas during the burst"
    assert max(encoder_counts) == 1 and running_replicas(ENC) == 1
    down_s = wait_for(lambda: running_replicas(LLM) == 1, 60, "the LLM pool to scale down")
    print(f"LLM pool 2 -> 1 replicas {down_s:.1f} s after the burst ended")
