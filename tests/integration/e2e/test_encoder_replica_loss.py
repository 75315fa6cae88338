"""Replica loss, last in the package (``run_last``, conftest.py): one test replaces an encoder replica
under the shared app, the other deletes the app."""

from __future__ import annotations

import asyncio
import io
import threading
from typing import Any

import httpx
import pytest
from openai import OpenAI
from PIL import Image

from tests.integration.e2e.common import (
    PORT,
    VL,
    ask,
    data_url,
    hf_generate,
    wait_for,
)
from tests.media import make_image_bytes

pytestmark = pytest.mark.usefixtures("app")  # the package's one app (conftest.py)


@pytest.mark.run_last(2)
def test_embeddings_lost_with_their_encoder_replica_are_encoded_again(
    client: OpenAI, app: dict[str, Any]
) -> None:
    """Kill the VL encoder replica that owns an image's embeddings; the same image again must still
    equal HF generate: the LLM replica finds the object lost, the router invalidates and re-encodes.
    Last in the module (named so): it replaces a replica under the shared app."""
    import ray
    from ray import serve

    png = make_image_bytes(70, 42, seed=404)
    content = [
        {"type": "image_url", "image_url": {"url": data_url(png, "image/png")}},
        {"type": "text", "text": "Once more?"},
    ]
    expected = hf_generate(
        app["dirs"][VL],
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Once more?"}]}],
        images=[Image.open(io.BytesIO(png)).convert("RGB")],
    )
    assert ask(client, VL, content).choices[0].message.content == expected

    def stats() -> dict[str, Any]:
        return dict(httpx.get(f"http://127.0.0.1:{PORT}/stats").json()[VL])

    def encoder_replicas() -> list[str]:
        prefix = f"SERVE_REPLICA::mmserve#EncoderServer-{VL}#"
        return [
            a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)
        ]

    before = stats()
    (victim,) = encoder_replicas()  # one replica: the one that computed the image
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)

    def replaced() -> bool:
        names = encoder_replicas()
        deployment = serve.status().applications["mmserve"].deployments[f"EncoderServer-{VL}"]
        running = deployment.replica_states.get("RUNNING", 0)
        return victim not in names and len(names) == 1 and running == 1 and deployment.status == "HEALTHY"

    wait_for(replaced, 25.0, "Serve to replace the killed encoder replica")
    # Asked again after other text, so the image's span is not in the LLM's prefix cache (a cached
    # span is served without fetching its embeddings, and so without noticing they are lost).
    lead = {"type": "text", "text": "Look at this."}
    expected_again = hf_generate(
        app["dirs"][VL],
        [{"role": "user", "content": [lead, {"type": "image"}, {"type": "text", "text": "Once more?"}]}],
        images=[Image.open(io.BytesIO(png)).convert("RGB")],
    )
    assert ask(client, VL, [lead, *content]).choices[0].message.content == expected_again
    after = stats()
    assert after["encoder_items_dispatched"] - before["encoder_items_dispatched"] == 1  # encoded again
    assert after["encoder_cache"]["invalidations"] - before["encoder_cache"]["invalidations"] == 1
    assert after["encoder_cache"]["reserved"] == 0


@pytest.mark.run_last(3)
def test_graceful_encoder_shutdown_invalidates_what_it_owns(client: OpenAI) -> None:
    """Serve runs each replica's ``__del__`` on graceful shutdown; the encoder replica's drops the
    cache entries holding its objects. Deletes the app, so it runs last (the fixture then shuts down)."""
    from ray import serve

    from cluster.cache_shards import cache_index_args, open_cache_index
    from cluster.config import default_config

    png = make_image_bytes(42, 70, seed=405)
    ask(client, VL, [{"type": "image_url", "image_url": {"url": data_url(png, "image/png")}}])
    before = httpx.get(f"http://127.0.0.1:{PORT}/stats").json()[VL]["encoder_cache"]
    (model,) = [m for m in default_config().models if m.name == VL]
    # The shards end with the app (their owner outlives its other replicas, then kills them): read
    # their books while the delete runs, and keep the last answer before they are gone.
    deleting = threading.Thread(target=serve.delete, args=("mmserve",))  # graceful: drains, __del__

    async def watch() -> dict[str, Any]:
        index = open_cache_index(*cache_index_args(model))
        last = await index.stats()
        deleting.start()
        while deleting.is_alive():
            try:
                last = await asyncio.wait_for(index.stats(), 1.0)
            except Exception:  # the shards are gone: the app's delete ended them
                break
            await asyncio.sleep(0.05)
        return last

    after = asyncio.run(watch())
    deleting.join(timeout=120)
    dropped = after["invalidations"] - before["invalidations"]
    assert dropped >= 1  # at least the image just encoded
    assert before["entries"] - after["entries"] == dropped and after["reserved"] == 0
