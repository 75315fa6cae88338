"""The README's cluster commands, run as a user runs them: ``ray start --head``, ``serve deploy`` of the
shipped ``cluster/deploy/serve-cpu.yaml`` (and of ``serve-cpu-pd.yaml``, E/P/D: a prefill and a decode
pool, the answer decoded on the decode replica from the KV it pulled), ``serve status`` until RUNNING, one chat request with the
``openai`` client (and a seeded sampled one, whose tokens must be the same on both), ``serve shutdown``, and the cluster stopped; every step a subprocess of the ``ray``
and ``serve`` command lines, in the README's environment (``RAY_AUTH_MODE=token``, Serve's settings).

The cluster has its own ``HOME`` (a fresh machine: no auth token until ``ray get-auth-token
--generate``), temp dir and ports (``cluster.bench.local_cluster``); the deployed config is the shipped file
with only Serve's HTTP port changed. The tiny model is generated where the file's ``models_cache_dir``
says, under that ``HOME``, and the answer is checked against HF generate on it.
"""

from __future__ import annotations

import base64
import io
import time
from pathlib import Path

import httpx
import yaml
from openai import OpenAI
from PIL import Image

from cluster.bench.local_cluster import REPO, LocalRayCluster, deploy_config, free_port
from tests.hf_oracle import hf_generate
from tests.media import make_image_bytes

SHIPPED = REPO / "cluster/deploy/serve-cpu.yaml"
SHIPPED_PD = REPO / "cluster/deploy/serve-cpu-pd.yaml"
MODEL = "tiny-qwen2-vl"
MAX_TOKENS = 6
LLM_POOLS = {SHIPPED: ["LLMServer"], SHIPPED_PD: ["LLMPrefillServer", "LLMDecodeServer"]}


def test_readme_cluster_commands_deploy_the_shipped_cpu_configs(tmp_path: Path) -> None:
    """One cluster, the two shipped configs one after the other (each deployed, answered, shut down)."""
    cluster = LocalRayCluster()
    try:
        cluster.start_head(num_cpus=2)
        seeded = [
            _deploy_answer_and_shut_down(cluster, shipped, tmp_path) for shipped in (SHIPPED, SHIPPED_PD)
        ]
        # a seeded sampled request: E/P/D's decode replica draws on from where the prefill replica's
        # generator left off (the first token's), so its tokens are the colocated pool's
        assert seeded[1] == seeded[0]
    finally:
        cluster.stop()
        left = cluster.leftovers()
        cluster.remove()
    assert not left, f"processes of the cluster alive after it was stopped: {left}"


def _deploy_answer_and_shut_down(cluster: LocalRayCluster, shipped: Path, tmp_path: Path) -> list[str]:
    """Deploy, answer, shut down: a seeded sampled answer's tokens, to compare across the deployments."""
    port = free_port()
    config = tmp_path / shipped.name
    deploy_config(shipped, config, http_port=port)
    expected = yaml.safe_load(shipped.read_text())
    expected["http_options"]["port"] = port
    expected["applications"][0]["args"]["port"] = port  # the ingress serves HTTP itself (direct)
    assert yaml.safe_load(config.read_text()) == expected  # the shipped file, but for the port

    cluster.deploy(config)
    _wait_running(cluster, "mmserve", timeout_s=420)
    status = cluster.serve_status()["applications"]["mmserve"]["deployments"]
    assert {name: d["status"] for name, d in status.items()} == {
        "IngressServer": "HEALTHY",
        f"EncoderCacheIndex-{MODEL}": "HEALTHY",
        f"EncoderServer-{MODEL}": "HEALTHY",
        **{f"{pool}-{MODEL}": "HEALTHY" for pool in LLM_POOLS[shipped]},
    }

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=180, max_retries=0)
    png = make_image_bytes(84, 56, seed=5)
    url = f"data:image/png;base64,{base64.b64encode(png).decode()}"
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe."}]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],  # type: ignore[list-item,misc]
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    model_dir = cluster.home / ".cache/mmserve/models/tiny-qwen2-vl"  # serve-cpu.yaml's cache dir
    image = Image.open(io.BytesIO(png)).convert("RGB")
    hf_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    assert reply.choices[0].message.content == hf_generate(model_dir, hf_messages, MAX_TOKENS, images=[image])
    assert reply.usage is not None and reply.usage.completion_tokens == MAX_TOKENS
    if shipped == SHIPPED_PD:  # the answer came from the decode replica, over the KV it pulled
        pools = httpx.get(f"http://127.0.0.1:{port}/stats?pools=true", timeout=30).json()
        assert _pd_counters(pools[MODEL]) == (1, 1), pools
    sampled = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=12,
        temperature=1.0,
        top_p=0.9,
        seed=11,
        logprobs=True,
    )
    assert sampled.choices[0].logprobs is not None and sampled.choices[0].logprobs.content is not None
    tokens = [t.token for t in sampled.choices[0].logprobs.content]

    cluster.shutdown_serve()
    assert not cluster.serve_status().get("applications")
    return tokens


def test_bench_config_rewrites_only_model_port_and_missing_markers(tmp_path: Path) -> None:
    """What `cluster.bench.vs_vllm --servers cluster2` deploys: the shipped file, with the model's path
    and name, the port, and node markers on the pools that set no resources; nothing else."""
    out = tmp_path / "c.yaml"
    markers = {"encoder": {"encoder_node": 0.001}, "llm": {"llm_node": 0.001}}
    deploy_config(SHIPPED, out, 8123, model_path="/m/dir", model_name="m", resources=markers)
    got = yaml.safe_load(out.read_text())
    want = yaml.safe_load(SHIPPED.read_text())
    model = want["applications"][0]["args"]["models"][0]
    assert model.pop("tiny") == "qwen2-vl"
    model.update(name="m", path="/m/dir")
    model["encoder"]["deployment"]["resources"] = {"encoder_node": 0.001}
    model["llm"]["deployment"]["resources"] = {"llm_node": 0.001}
    want["http_options"]["port"] = 8123
    want["applications"][0]["args"]["port"] = 8123
    assert got == want

    model["llm"]["deployment"]["resources"] = {"llm_node": 0.5}  # a file's own markers are kept
    pinned = tmp_path / "pinned.yaml"
    pinned.write_text(yaml.safe_dump(want))
    deploy_config(pinned, out, 8123, resources=markers)
    assert yaml.safe_load(out.read_text())["applications"][0]["args"]["models"][0]["llm"]["deployment"][
        "resources"
    ] == {"llm_node": 0.5}


def _wait_running(cluster: LocalRayCluster, app: str, timeout_s: float) -> None:
    """Until ``app`` is RUNNING (raises on DEPLOY_FAILED or timeout), read where ``serve status`` reads
    it, the dashboard's REST API, with the cluster's token: a ``serve status`` process every 2 s
    (``cluster.wait_running``) costs ~1.3 CPU-s each, competing with the replicas' start on 2 cores.
    The test still runs ``serve status`` itself once the app is up."""
    token = (cluster.home / ".ray/auth_token").read_text().strip()
    url, headers = f"{cluster.dashboard_url}/api/serve/applications/", {"Authorization": f"Bearer {token}"}
    deadline = time.monotonic() + timeout_s
    state = None
    while time.monotonic() < deadline:
        apps = httpx.get(url, headers=headers, timeout=30).raise_for_status().json().get("applications") or {}
        state = (apps.get(app) or {}).get("status")
        if state == "RUNNING":
            return
        assert state != "DEPLOY_FAILED", apps[app]
        cluster.members()  # learn the pids while it starts, so stop() finds them all
        time.sleep(0.5)
    raise AssertionError(f"{app} not RUNNING after {timeout_s:.0f} s (last: {state})")


def _pd_counters(stats: dict[str, object]) -> tuple[int, int]:
    """(hand-offs by the prefill replicas, imports by the decode replicas) in an ingress's
    ``/stats?pools=true`` entry of a model: every LLM replica it read from, tagged by its ``role``."""
    replicas = stats["pools"]["llm_replicas"]  # type: ignore[index]
    by_role: dict[str, int] = {"prefill": 0, "decode": 0}
    for counters in replicas.values():
        role = counters.get("role")
        if role in by_role:
            by_role[role] += int(counters["kv_handoffs" if role == "prefill" else "kv_imports"])
    return by_role["prefill"], by_role["decode"]
