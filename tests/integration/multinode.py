"""What the multi-node modules share (tests/integration/test_multinode.py, chaos/test_pd_multinode.py):
the app on a Ray cluster of several raylets on this machine (``ray.cluster_utils.Cluster``, its head
started by ``cluster.bench.chaos_node.start_head``: again where a busy host missed Ray's start-up
wait), where Serve placed each replica, pool sizes, and a burst that keeps fresh requests in flight
until a condition holds."""

from __future__ import annotations

import asyncio
import base64
import io
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from tests.hf_oracle import hf_generate
from tests.integration.local_app import free_port, own_ray, seed_tiny_models

Request = tuple[Any, list[dict[str, Any]], int]  # (key, messages, max_tokens)


@contextmanager
def multinode_app(
    tmp_path_factory: pytest.TempPathFactory,
    head_cpus: int,
    nodes: dict[str, tuple[int, dict[str, float]]],
    app_config: Callable[[int, str], dict[str, Any]],
) -> Iterator[dict[str, Any]]:
    """A head of ``head_cpus`` CPUs, then one node per ``nodes`` entry (role: its CPUs and custom
    resources), and the app of ``app_config(port, models_cache_dir)`` started on them. Yields the node
    ids by role (``head`` too), the models' cache dir and the port; the cluster is shut down after."""
    from cluster.bench.chaos_node import start_head
    from cluster.config import AppConfig
    from cluster.serve_cli import start

    c = start_head({"num_cpus": head_cpus, "include_dashboard": False})
    try:
        ids = {role: c.add_node(num_cpus=cpus, resources=res).node_id for role, (cpus, res) in nodes.items()}
        c.wait_for_nodes()
        with own_ray(c.address):
            port = free_port()
            cache_dir = tmp_path_factory.mktemp("models")
            config = app_config(port, str(cache_dir))
            seed_tiny_models(config)
            start(AppConfig.model_validate(config))
            yield {"nodes": {"head": c.head_node.node_id, **ids}, "cache_dir": Path(cache_dir), "port": port}
    finally:
        c.shutdown()


def alive_actors(class_suffix: str) -> list[dict[str, Any]]:
    """Live actors whose class name ends with ``class_suffix``, from the GCS actor table."""
    import ray

    table = ray._private.state.actors()  # the GCS view; the state API would need the dashboard
    return [a for a in table.values() if a["State"] == "ALIVE" and a["ActorClassName"].endswith(class_suffix)]


def _states(deployment: str) -> dict[str, int]:
    from ray import serve

    d = serve.status().applications["mmserve"].deployments[deployment]
    return {str(getattr(s, "value", s)): int(n) for s, n in d.replica_states.items()}


def running(deployment: str) -> int:
    return _states(deployment).get("RUNNING", 0)


def wanted(deployment: str) -> int:
    """Replicas starting or running (not stopping): what the pool has grown to."""
    return sum(n for s, n in _states(deployment).items() if s not in ("STOPPING", "STOPPED"))


def image_messages(png: bytes, text: str = "Describe.") -> list[dict[str, Any]]:
    url = f"data:image/png;base64,{base64.b64encode(png).decode()}"
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def hf_for_image(model_dir: Path, png: bytes, max_tokens: int, text: str = "Describe.") -> str:
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    return hf_generate(model_dir, messages, max_tokens, images=[Image.open(io.BytesIO(png)).convert("RGB")])


async def burst(
    port: int,
    model: str,
    next_request: Callable[[], Request],
    concurrency: int,
    until: Callable[[], bool],
    max_s: float,
) -> tuple[dict[Any, Any], float | None]:
    """Keep ``concurrency`` fresh requests in flight until ``until()`` holds (or ``max_s`` passes), then
    let them finish. Returns each answer (or exception) by key, and the seconds from the first request
    to when ``until()`` first held (None if it never did)."""
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", timeout=180, max_retries=0)
    start = time.monotonic()
    reached: list[float] = []
    answers: dict[Any, Any] = {}

    async def worker() -> None:
        while not reached and time.monotonic() - start < max_s:
            key, messages, max_tokens = next_request()
            try:
                r = await client.chat.completions.create(
                    model=model,
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


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until ``cond()`` holds; fails after ``timeout_s``."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.25)
    return time.monotonic() - start
