"""The load of a chaos scenario, and what the driver reads of the app around a fault.

``run_load`` sends a fixed list of requests (64 at c=8 in the scenarios) as streamed chat completions
with the ``openai`` client, each under its own deadline, and records each one's ``Outcome``
(``chaos_outcomes.py``). The readings (pool sizes, what is still held, the named actors) ask Ray and
Serve from a driver connected to the app's cluster; ``kill_replica`` SIGKILLs one Serve replica's
process (its PID asked from the actor itself).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import openai

from cluster.bench.chaos_outcomes import LOST, Outcome, classify
from cluster.bench.client import make_client
from cluster.bench.media import make_image_bytes
from cluster.bench.workload import RequestSpec, data_url

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

APP = "mmserve"


def image_specs(
    model: str, n: int, images_per_request: int = 1, size: int = 224, seed: int = 0
) -> list[RequestSpec]:
    """``n`` requests, each with ``images_per_request`` distinct images (never cached) and a question."""
    specs = []
    for i in range(n):
        parts: list[Mapping[str, object]] = []
        for j in range(images_per_request):
            png = make_image_bytes(size, size, seed=seed + 1000 * i + j)
            parts.append({"type": "image_url", "image_url": {"url": data_url(png, "image/png")}})
        parts.append({"type": "text", "text": f"Request {seed}-{i}: what is in these pictures?"})
        specs.append(RequestSpec("image", model, parts))
    return specs


@dataclass
class Load:
    """``specs`` sent ``concurrency`` at a time; ``started`` counts the requests sent so far."""

    base_url: str
    specs: Sequence[RequestSpec]
    concurrency: int = 8
    deadline_s: float = 180.0
    max_tokens: int = 8
    outcomes: list[Outcome] = field(default_factory=list)
    started: int = 0

    async def _one(self, client: openai.AsyncOpenAI, spec: RequestSpec) -> Outcome:
        start = time.monotonic()
        exc: BaseException | None = None
        timed_out = False
        try:
            await asyncio.wait_for(self._stream(client, spec), self.deadline_s)
        except TimeoutError as e:
            timed_out, exc = True, e
        except Exception as e:  # every failure is one outcome of the table
            exc = e
        verdict, code = classify(exc, timed_out)
        detail = "" if exc is None else f"{type(exc).__name__}: {exc}"[:300]
        if verdict == LOST:
            detail = f"no answer within {self.deadline_s:.0f} s"
        return Outcome(spec.kind, start, time.monotonic(), verdict, code, detail)

    async def _stream(self, client: openai.AsyncOpenAI, spec: RequestSpec) -> None:
        stream = await client.chat.completions.create(
            model=spec.model,
            messages=cast("list[ChatCompletionMessageParam]", spec.messages()),
            max_tokens=self.max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for _ in stream:
            pass

    async def run(self) -> list[Outcome]:
        # The client's own timeout is past the deadline: a hang is counted by wait_for, as lost.
        client = make_client(self.base_url, self.deadline_s + 30)
        todo = iter(self.specs)

        async def worker() -> None:
            for spec in todo:
                self.started += 1
                self.outcomes.append(await self._one(client, spec))

        try:
            await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        finally:
            await client.close()
        return self.outcomes

    async def wait_started(self, n: int, timeout_s: float = 600.0) -> None:
        t0 = time.monotonic()
        while self.started < n and time.monotonic() - t0 < timeout_s:
            await asyncio.sleep(0.05)


# -- what the driver reads of the app (a driver connected to its Ray) --------------------------------


def replica_names(deployment: str) -> list[str]:
    import ray

    prefix = f"SERVE_REPLICA::{APP}#{deployment}#"
    return sorted(
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)
    )


def pool_states() -> dict[str, dict[str, int]]:
    """Every deployment of the app: its replicas by state (RUNNING, STARTING, ...)."""
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None:
        return {}
    return {
        name: {str(getattr(s, "value", s)): int(n) for s, n in d.replica_states.items()}
        for name, d in app.deployments.items()
    }


def running(deployment: str) -> int:
    return pool_states().get(deployment, {}).get("RUNNING", 0)


def wanted(deployment: str) -> int:
    """Replicas starting or running (not stopping): what the pool has grown to."""
    states = pool_states().get(deployment, {})
    return sum(n for s, n in states.items() if s not in ("STOPPING", "STOPPED"))


def replica_pid(name: str) -> int:
    """The process of a Serve replica actor (asked from the actor itself)."""
    import ray

    actor = ray.get_actor(name, namespace="serve")
    return int(ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30))


def kill_replica(deployment: str, pick: Callable[[list[str]], str] = lambda names: names[0]) -> str:
    """SIGKILL one replica's process (its PID asked from the actor); returns the actor's name."""
    name = pick(replica_names(deployment))
    os.kill(replica_pid(name), signal.SIGKILL)
    return name


def wait_until(cond: Callable[[], bool], timeout_s: float, poll_s: float = 0.5) -> float | None:
    """Seconds until ``cond()`` holds (exceptions count as not yet), or None after ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if cond():
                return time.monotonic() - t0
        except Exception:  # the cluster is recovering: ask again
            pass
        time.sleep(poll_s)
    return None


def at_capacity(targets: dict[str, int]) -> bool:
    """Each pool runs at least its target replicas, none starting, and the app is RUNNING."""
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None or str(getattr(app.status, "value", app.status)) != "RUNNING":
        return False
    states = pool_states()
    return all(
        states.get(d, {}).get("RUNNING", 0) >= n and not states.get(d, {}).get("STARTING", 0)
        for d, n in targets.items()
    )


_REPLICA = re.compile(rf"^SERVE_REPLICA::{APP}#(?P<deployment>[^#]+)#")


def named_actor_leaks(models_shards: dict[str, int]) -> list[str]:
    """Named actors of the app beyond what it should have now: more replica actors of a deployment
    than Serve counts in it (a dead replica's name still registered), or more cache-index shards of a
    model than it is configured with."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    states = pool_states()
    leaks = []
    per_deployment: dict[str, list[str]] = {}
    for name in names:
        m = _REPLICA.match(name)
        if m:
            per_deployment.setdefault(m["deployment"], []).append(name)
    for deployment, found in per_deployment.items():
        counted = sum(states.get(deployment, {}).values())
        if len(found) > counted:
            leaks.append(f"{deployment}: {len(found)} replica actors, Serve counts {counted}")
    for model, shards in models_shards.items():
        found = [n for n in names if n.startswith(f"mmserve-encoder-cache-{model}-")]
        if len(found) > shards:
            leaks.append(f"{model}: {len(found)} cache shards, configured {shards}")
    return leaks


def held(
    model: str,
    cache_index: tuple[str, int, int, int],
    asks: int = 4,
    llm_pools: Sequence[str] = ("LLMServer",),
) -> dict[str, int]:
    """The leak baseline (``tests/integration/e2e/app_readings.nothing_held``): requests running or
    waiting on an LLM replica, KV blocks outside the free list, encoder-cache entries reserved; and
    embedding refs the encoder replicas hold beyond the index's entries. ``llm_pools``: the model's LLM
    deployments (E/P/D: ``LLMPrefillServer`` and ``LLMDecodeServer``), summed; a prefill replica's
    hand-off pins still held (neither pulled nor expired) count as ``handoff_pins``.
    A pool's stats go to one replica per call: asked ``asks`` times, the largest of each kept (the
    pools are at one replica once settled)."""
    import asyncio as _asyncio

    from ray import serve

    from cluster.cache_shards import open_cache_index

    out = {"running": 0, "waiting": 0, "kv_blocks_held": 0}
    for pool in llm_pools:
        handle = serve.get_deployment_handle(f"{pool}-{model}", app_name=APP)
        most: dict[str, int] = {}
        for _ in range(asks):
            s = handle.stats.remote().result(timeout_s=30)
            now = {
                "running": int(s["num_running"]),
                "waiting": int(s["num_waiting"]),
                "kv_blocks_held": int(s["num_total_blocks"] - s["num_free_blocks"]),
            }
            if s.get("role") == "prefill":
                now["handoff_pins"] = int(s["kv_pins_held"])
            most = {k: max(v, most.get(k, 0)) for k, v in now.items()}
        for k, v in most.items():
            out[k] = out.get(k, 0) + v
    cache = _asyncio.run(open_cache_index(*cache_index).stats())
    out["reserved"] = _int(cache["reserved"])
    # Refs: what the encoder replicas keep alive beyond what the index lists. Each replica drops a
    # ref at its first sweep after the index stops holding it (evicted, plus a grace): once the pool
    # settles, a positive count is a ref kept for nothing.
    enc = serve.get_deployment_handle(f"EncoderServer-{model}", app_name=APP)
    owned = max(int(enc.stats.remote().result(timeout_s=30)["owned_embeddings"]) for _ in range(asks))
    out["refs_beyond_index"] = max(0, owned - _int(cache["entries"]))
    return out


def _int(x: object) -> int:
    return x if isinstance(x, int) else 0
