"""What every e2e module shares: where the app listens, the HF oracle, request helpers."""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from openai import OpenAI

from tests.hf_oracle import hf_generate as oracle_generate

PORT = int(os.environ.get("MMSERVE_E2E_PORT", "8431"))  # another port: beside a run on 8431
MAX_TOKENS = 8
VL, AUDIO = "tiny-qwen2-vl", "tiny-qwen2-audio"


def hf_generate(model_dir: Path, messages: list[dict[str, Any]], **media: Any) -> str:
    return oracle_generate(model_dir, messages, MAX_TOKENS, **media)


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def ask(client: OpenAI, model: str, content: Any, **kw: Any) -> Any:
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        **kw,
    )


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.2)


async def send_concurrently(
    base_url: str, send: Callable[[Any, int], Awaitable[int]], indices: list[int], concurrency: int
) -> list[int]:
    """``send(client, i)`` for every index, at most ``concurrency`` at once, with one AsyncOpenAI client."""
    import asyncio

    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", timeout=300, max_retries=0)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> int:
        async with gate:
            return await send(client, i)

    try:
        return list(await asyncio.gather(*(one(i) for i in indices)))
    finally:
        await client.close()


def holders() -> dict[str, dict[tuple[Any, str], int]]:
    """Every referenced object -> each worker holding it -> its local reference count there."""
    import ray
    from ray._private.internal_api import get_state_from_address, node_stats
    from ray.dashboard.utils import node_stats_to_dict

    state = get_state_from_address(ray.get_runtime_context().gcs_address)
    held: dict[str, dict[tuple[Any, str], int]] = {}
    for raylet in state.node_table():
        if raylet["Alive"]:
            stats = node_stats_to_dict(node_stats(raylet["NodeManagerAddress"], raylet["NodeManagerPort"]))
            for worker in stats["coreWorkersStats"]:
                who = (worker.get("pid"), str(worker.get("actorTitle") or worker.get("workerType")))
                for ref in worker.get("objectRefs", []):
                    held.setdefault(ref["objectId"], {})[who] = int(ref.get("localRefCount") or 0)
    return held


def more_references(before: dict[str, dict[tuple[Any, str], int]]) -> list[str]:
    """One line per reference more than at ``before`` that a worker holds to an object referenced then
    (the cached embeddings among them: a kept request would reference those, not new objects)."""
    now = holders()
    return [
        f"{oid}: {who}"
        for oid, was in before.items()
        for who, n in now.get(oid, {}).items()
        for _ in range(n - was.get(who, 0))
    ]
