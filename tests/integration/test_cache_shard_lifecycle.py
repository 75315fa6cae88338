"""The encoder cache's index shards live and die with the application (cluster/cache_shards.py), and
``ingress.transport: serve`` opens no side channel, to them or to the pool replicas (the LLM
replica's outputs come back on Serve's stream; with ``auto``, on the link).

One Ray for the module; the whole app (tiny Qwen2-VL, one replica per pool) deployed twice on it,
with ``transport: auto`` and with ``serve``. Each time: image requests go through the shards, the
shard process's listening sockets are read from /proc before and after, and ``serve.delete`` must
leave no shard actor alive (the GCS's live named actors; the module's Ray runs without a dashboard,
hence without the state API).
"""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.local_app import free_port, own_ray, seed_tiny_models
from tests.media import make_image_bytes

APP = "mmserve"


@pytest.fixture(scope="module")
def ray_session() -> Any:
    from cluster.serve_env import apply_serve_env

    apply_serve_env()
    with own_ray(log_to_driver=False):
        yield


def _config(tmp_path: Path, port: int, transport: str, model: str) -> Any:
    from cluster.config import AppConfig

    one = {"num_replicas": 1, "num_cpus": 0.1}
    return AppConfig.model_validate(
        {
            "port": port,
            "models_cache_dir": str(tmp_path / "models"),
            "ingress": {"http_mode": "direct", "transport": transport, "deployment": one},
            "models": [
                {
                    "name": model,
                    "tiny": "qwen2-vl",
                    "llm": {"max_model_len": 2048, "num_kv_blocks": 256, "deployment": one},
                    "encoder": {"deployment": one, "cache_index_shards": 2},
                    # `serve` also carries overlap prefill's calls: prepare_stream as Serve's streaming
                    # call, each item's arrival at the LLM replica as a handle call to that replica
                    "preprocess": {"overlap_prefill": transport == "serve"},
                }
            ],
        }
    )


def _alive(prefix: str) -> list[dict[str, str]]:
    """The live named actors whose name starts with ``prefix``, in any namespace."""
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]


def _pid(actor: dict[str, str]) -> int:
    import ray

    handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
    return int(ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=30))


def _listening(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (IPv4 and IPv6)."""
    return {port for _, port in _listening_at(pid)}


def _listening_at(pid: int) -> set[tuple[bool, int]]:
    """(on all interfaces?, port) of each TCP socket process ``pid`` listens on, from /proc: its
    socket inodes matched against the kernel's tables of listening sockets."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].rsplit(":", 1)
                ports.add((set(address) == {"0"}, int(port, 16)))
    return ports


def _ask_about_images(url: str, model: str, seeds: list[int]) -> None:
    for seed in seeds:
        png = make_image_bytes(56, 56, seed=seed)
        image = {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()},
        }
        body = {
            "model": model,
            "messages": [{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}],
            "max_tokens": 2,
        }
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text


def _until_none_alive(prefix: str) -> list[dict[str, str]]:
    for _ in range(100):  # the GCS marks an actor dead a moment after its process ends
        if not (alive := _alive(prefix)):
            return []
        time.sleep(0.2)
    return alive


@pytest.mark.parametrize("transport", ["auto", "serve"])
def test_shards_end_with_the_app_and_serve_transport_opens_no_link(
    ray_session: Any, tmp_path: Path, transport: str
) -> None:
    from ray import serve

    from cluster.serve_cli import start

    port = free_port()
    model = f"tiny-qwen2-vl-{transport}"  # its own shard names: none left from another case can pass
    shards_prefix = f"mmserve-encoder-cache-{model}-"
    owner_prefix = f"SERVE_REPLICA::{APP}#EncoderCacheIndex-{model}#"
    config = _config(tmp_path, port, transport, model)
    seed_tiny_models(config.model_dump())
    start(config)
    try:
        shards = [_pid(a) for a in _alive(shards_prefix)]
        assert len(shards) == 2 and len(_alive(owner_prefix)) == 1
        before = {pid: _listening(pid) for pid in shards}
        _ask_about_images(f"http://127.0.0.1:{port}", model, [1, 2, 3, 1, 2, 3])  # misses, then hits
        after = {pid: _listening(pid) for pid in shards}
        opened = {pid: after[pid] - before[pid] for pid in before}
        if transport == "serve":
            assert opened == {pid: set() for pid in before}, f"a shard listens on {opened}"
        else:  # the same check sees a link when there is one: the hot calls went over it
            assert any(opened.values()), f"no shard opened a link: {before} -> {after}"
        llm = httpx.get(f"http://127.0.0.1:{port}/stats?pools=true", timeout=30).json()[model]["pools"]
        (outputs,) = llm["llm_replicas"].values()  # how the tokens came back: the link, or Serve's stream
        assert (outputs["link_channel_batches"] > 0) == (transport == "auto"), outputs
        for pool in ("EncoderServer", "LLMServer"):  # Ray's core worker, Serve's gRPC, and a link or not
            (replica,) = _alive(f"SERVE_REPLICA::{APP}#{pool}-{model}#")
            sockets = _listening_at(_pid(replica))
            assert len(sockets) == (2 if transport == "serve" else 3), f"{pool} listens on {sockets}"
        _kill_for_good_and_see_it_back(shards_prefix, port, model)
    finally:
        serve.delete(APP)
    assert not _until_none_alive(shards_prefix), "a shard outlived `serve delete`"
    assert not _alive(owner_prefix)


def _kill_for_good_and_see_it_back(shards_prefix: str, port: int, model: str) -> None:
    """A shard killed for good (no restart by Ray) is created again by its owner's health check, and
    the replicas find the new one by name: image requests still succeed."""
    import ray

    victim = _alive(shards_prefix)[0]
    old_pid = _pid(victim)
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    for _ in range(150):
        back = [a for a in _alive(shards_prefix) if a["name"] == victim["name"]]
        if back and _pid(back[0]) != old_pid:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"{victim['name']} was not created again")
    _ask_about_images(f"http://127.0.0.1:{port}", model, [4, 5, 4])
