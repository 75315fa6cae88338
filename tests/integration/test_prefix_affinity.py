"""Two LLM replicas behind the prefix-affinity router: repeats of a conversation land on the replica
that holds its prefix (their prompt comes from that replica's KV cache), while distinct
conversations spread over both. Real Ray Serve, real HTTP, the openai client.

The ingress submits over direct links (mmcore/link/pool_links.py), routed by the LLM pool's own Serve
router: a cold image conversation prepared on an encoder replica, its repeat (served from the encoder
cache at the ingress) both choose by the same prefix index."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from openai import OpenAI

MODEL = "tiny-qwen2-vl"
LLM = f"LLMServer-{MODEL}"
CONVERSATIONS = 16
_LOOP = asyncio.new_event_loop()  # Serve's handles here keep their router on the loop that made them


@pytest.fixture(scope="module")
def app(vl_pair_app: OpenAI) -> dict[str, Any]:
    """tests/integration/conftest.py's app, shared with test_docs_examples.py: this model's LLM pool
    has two replicas."""
    return {"client": vl_pair_app}


def _replica_stats() -> dict[str, dict[str, Any]]:
    """Each LLM replica's own counters, asked of it by name (the router honours ``target_replica``)."""
    import ray
    from ray import serve

    from llm_service.request_spec import ReplicaTarget

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    ids = [n.rsplit("#", 1)[-1] for n in names if n.startswith(f"SERVE_REPLICA::mmserve#{LLM}#")]

    async def ask() -> dict[str, dict[str, Any]]:  # a handle whose router runs on its caller's loop
        handle = serve.get_deployment_handle(LLM, app_name="mmserve")
        return {rid: await handle.stats.remote(ReplicaTarget(rid)) for rid in ids}

    stats = _LOOP.run_until_complete(ask())
    for rid, s in stats.items():
        assert s["replica_id"] == rid  # the targeted call reached the replica it named
    return stats


def _conversation(i: int) -> list[dict[str, Any]]:
    system = f"Conversation {i}. " + " ".join(f"fact {i}-{k} is {k * i % 97}." for k in range(24))
    return [{"role": "system", "content": system}, {"role": "user", "content": "Summarise the facts."}]


def _ask(client: OpenAI, messages: list[dict[str, Any]]) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)


def test_distinct_conversations_spread_and_repeats_hit_their_replica(app: dict[str, Any]) -> None:
    client: OpenAI = app["client"]
    before = _replica_stats()
    assert len(before) == 2
    with ThreadPoolExecutor(8) as pool:
        first = list(pool.map(lambda i: _ask(client, _conversation(i)), range(CONVERSATIONS)))
    after = _replica_stats()
    queried = {rid: after[rid]["prefix_query_tokens"] - before[rid]["prefix_query_tokens"] for rid in after}
    assert all(q > 0 for q in queried.values()), f"one replica got nothing: {queried}"

    block = 16
    for i in range(0, CONVERSATIONS, 2):
        for _ in range(2):
            again = _ask(client, _conversation(i))
            prompt = again.usage.prompt_tokens
            cached = again.usage.prompt_tokens_details.cached_tokens
            # Every full block of the prompt but the last token's comes from the replica's KV cache.
            assert cached >= (prompt - 1) // block * block - block, (i, prompt, cached)
            assert again.choices[0].message.content == first[i].choices[0].message.content


def _image_conversation(i: int) -> list[dict[str, Any]]:
    import base64

    from tests.media import make_image_bytes

    url = (
        "data:image/png;base64," + base64.b64encode(make_image_bytes(56 + 28 * (i % 2), 56, seed=i)).decode()
    )
    text = f"Picture {i}. " + " ".join(f"note {i}-{k}." for k in range(12))
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def test_an_image_conversation_repeated_hits_the_replica_that_holds_it(app: dict[str, Any]) -> None:
    """First turn cold: prepared on an encoder replica, submitted over a link. The repeat is all
    encoder-cache hits, prepared at the ingress: it must find the replica that holds the prefix."""
    client: OpenAI = app["client"]
    n = 8
    with ThreadPoolExecutor(4) as pool:
        first = list(pool.map(lambda i: _ask(client, _image_conversation(i)), range(n)))
    block = 16
    for i in range(n):
        again = _ask(client, _image_conversation(i))
        prompt = again.usage.prompt_tokens
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached >= (prompt - 1) // block * block - block, (i, prompt, cached)
        assert again.choices[0].message.content == first[i].choices[0].message.content


def test_each_replica_runs_on_the_core_its_pool_gave_it(app: dict[str, Any]) -> None:
    """``deployment.cpu_affinity: "A|B"`` (tests/integration/conftest.py): each of the two replicas
    claimed one of the sets on this node, and every thread of its process runs on that core alone."""
    from tests.integration.conftest import PAIR_CORES

    if PAIR_CORES is None:
        pytest.skip("one core: the pair is not pinned")
    cores = [s["cpu_affinity"] for s in _replica_stats().values()]
    want = [[int(c)] for c in PAIR_CORES.split("|")]
    assert sorted(cores) == sorted(want), cores
    # the ingress replica that answers /stats reports its own, as the pools' replicas do
    base = str(app["client"].base_url).removesuffix("/").removesuffix("/v1")
    stats = httpx.get(f"{base}/stats?pools=true", timeout=30, trust_env=False).json()
    ingress = stats[MODEL]["pools"]["ingress_replica"]
    assert ingress["cpu_affinity"] == sorted(c for w in want for c in w) and ingress["replica_id"]
