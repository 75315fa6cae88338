"""Two tenants over real HTTP (issue 11, item 2 and the rest of item 10): API keys (401 in OpenAI's
shape, /health open; Serve's proxy and the ingress's own server both), uuids that stay in their
tenant and cannot be poisoned by other bytes, cache_salt and per-tenant prefix-cache isolation, the
parsed-size bound of a body, and ingress.request_timeout_s end to end (504, KV blocks freed).

One app on the module's own Ray: the ingress serves HTTP itself (direct) AND Serve's proxy runs on a
second port in front of the same replica, so every route is tried both ways. Answers are checked
against transformers' generate on the same weights.
"""

from __future__ import annotations

import io
import json
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from PIL import Image

from tests.hf_oracle import hf_generate
from tests.integration.e2e.common import data_url, wait_for
from tests.integration.local_app import free_port, own_ray, seed_tiny_models, shutdown_wait_loop
from tests.media import make_image_bytes

MODEL = "tiny-qwen2-vl"
KEYS = {"alpha": "sk-alpha-7d1f0c", "beta": "sk-beta-93ab2e"}
OPERATOR_KEY = "sk-operator-4c02de"  # /stats: counters across tenants
TIMEOUT_S = 8.0
MAX_TOKENS = 8
LONG_TOKENS = 60_000  # a generation no 2-core host finishes within TIMEOUT_S (~0.7 ms a token at best)


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import ray
    from ray import serve

    from cluster.app import build_app
    from cluster.config import AppConfig
    from cluster.serve_env import apply_serve_env

    tmp = tmp_path_factory.mktemp("tenancy")
    keys_file = tmp / "keys.yaml"
    keys_file.write_text("".join(f"{key}: {tenant}\n" for tenant, key in KEYS.items()))
    direct, proxy = free_port(), free_port()
    cfg = AppConfig.model_validate(
        {
            # room for generations that outlast request_timeout_s however fast decoding gets
            # (4,000 tokens of two requests once finished inside 8 s)
            "models": [
                {
                    "name": MODEL,
                    "tiny": "qwen2-vl",
                    "llm": {
                        "max_model_len": LONG_TOKENS + 512,
                        "num_kv_blocks": 2 * (LONG_TOKENS + 512) // 16 + 64,
                    },
                }
            ],
            "models_cache_dir": str(tmp / "models"),
            "port": direct,
            "ingress": {
                "http_mode": "direct",
                "api_keys_file": str(keys_file),
                "operator_api_key": OPERATOR_KEY,
                "request_timeout_s": TIMEOUT_S,
            },
        }
    )
    seed_tiny_models(cfg.model_dump())
    apply_serve_env()
    with own_ray():
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": proxy})
        with shutdown_wait_loop():  # a quick teardown
            serve.run(build_app(cfg), name="mmserve", route_prefix="/")
        yield {
            "direct": f"http://127.0.0.1:{direct}",
            "proxy": f"http://127.0.0.1:{proxy}",
            "model_dir": tmp / "models" / MODEL,
            "logs": ray._private.worker._global_node.get_logs_dir_path(),
        }


def _client(app: dict[str, Any], tenant: str, mode: str = "direct") -> OpenAI:
    return OpenAI(base_url=f"{app[mode]}/v1", api_key=KEYS[tenant], timeout=60, max_retries=0)


def _auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.mark.parametrize("mode", ["direct", "proxy"])
def test_keys_are_required_everywhere_but_health(app: dict[str, Any], mode: str) -> None:
    base = app[mode]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEYS["alpha"]}):
        r = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 401, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key" and err["message"]
        assert "sk-" not in r.text
    for path in ("/v1/models", "/stats"):
        assert httpx.get(f"{base}{path}", timeout=60).status_code == 401
    assert httpx.get(f"{base}/v1/models", headers=_auth("beta"), timeout=60).status_code == 200
    operator = {"Authorization": f"Bearer {OPERATOR_KEY}"}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, headers=operator, timeout=60)
    assert r.status_code == 401, r.text  # the operator key is no tenant's: it opens /stats only
    assert httpx.get(f"{base}/health", timeout=60).status_code == 200
    r = httpx.post(f"{base}/v1/chat/completions", json=body, headers=_auth("alpha"), timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("mode", ["direct", "proxy"])
def test_stats_show_counters_across_tenants_to_the_operator_key_alone(app: dict[str, Any], mode: str) -> None:
    """/stats tells whether anyone sent an image (its cache hits and misses, across tenants): a
    tenant's key there is a 403 naming the operator key; the operator key sees the counters."""
    base = app[mode]
    for tenant in KEYS:
        r = httpx.get(f"{base}/stats", headers=_auth(tenant), timeout=60)
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["code"] == "operator_key_required" and "operator key" in err["message"]
    for bad in ("Bearer sk-wrong", f"Bearer {OPERATOR_KEY}x"):
        assert httpx.get(f"{base}/stats", headers={"Authorization": bad}, timeout=60).status_code == 401
    r = httpx.get(f"{base}/stats", headers={"Authorization": f"Bearer {OPERATOR_KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    assert set(r.json()[MODEL]["encoder_cache"]) >= {"hits", "misses", "uuid_names"}


def _image_part(data: bytes | None, name: str | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "image_url"}
    if data is not None:
        part["image_url"] = {"url": data_url(data, "image/png")}
    if name is not None:
        part["uuid"] = name
    return part


def _describe(client: OpenAI, data: bytes | None = None, name: str | None = None) -> str:
    content = [_image_part(data, name), {"type": "text", "text": "Describe."}]
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS, temperature=0
    )
    return str(r.choices[0].message.content)


def _hf_describe(model_dir: Path, data: bytes) -> str:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    return hf_generate(model_dir, messages, MAX_TOKENS, images=[Image.open(io.BytesIO(data)).convert("RGB")])


def test_uuids_stay_in_their_tenant_and_other_bytes_cannot_poison_them(app: dict[str, Any]) -> None:
    red, blue = make_image_bytes(64, 48, seed=11), make_image_bytes(96, 64, seed=12)
    hf_red, hf_blue = _hf_describe(app["model_dir"], red), _hf_describe(app["model_dir"], blue)
    assert hf_red != hf_blue  # otherwise this test could not tell the two images apart
    alpha, beta = _client(app, "alpha"), _client(app, "beta", "proxy")
    cat, dog = f"cat-{uuid.uuid4().hex}", f"dog-{uuid.uuid4().hex}"
    assert _describe(alpha, red, cat) == hf_red
    assert _describe(beta, blue, cat) == hf_blue  # B's bytes under A's name: B gets its own image
    assert _describe(alpha, name=cat) == hf_red  # ...and A still gets its own
    assert _describe(beta, name=cat) == hf_blue
    assert _describe(alpha, red, dog) == hf_red
    with pytest.raises(openai.BadRequestError) as e:  # A's name means nothing to B
        _describe(beta, name=dog)
    assert e.value.code == "mm_cache_miss"
    assert _describe(beta, red) == hf_red  # the same bytes are the same content for anyone


def test_cache_salt_and_tenants_separate_prefix_cache_hits(app: dict[str, Any]) -> None:
    facts = " ".join(f"fact {k} is {k * 37 % 101}." for k in range(40))
    # a system prompt of this run's own: its first KV block is not the chat template's default preamble,
    # which every earlier request of a tenant shares under that tenant's salt
    messages = [
        {"role": "system", "content": f"{uuid.uuid4().hex} {facts}"},
        {"role": "user", "content": "Summarise."},
    ]

    def cached(tenant: str, **extra: Any) -> int:
        r = _client(app, tenant).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, temperature=0, extra_body=extra
        )
        assert r.usage is not None and r.usage.prompt_tokens > 64
        details = r.usage.prompt_tokens_details
        return int(details.cached_tokens or 0) if details is not None else 0

    assert cached("alpha", cache_salt="s1") == 0
    assert cached("alpha", cache_salt="s1") > 0
    assert cached("alpha", cache_salt="s2") == 0  # another salt: no hit
    assert cached("alpha") == 0  # the tenant's own default salt
    assert cached("alpha") > 0
    assert cached("beta") == 0  # same text, another tenant
    assert cached("beta", cache_salt="s1") == 0  # same salt as alpha's, still another tenant


def test_a_body_that_parses_into_too_many_values_is_refused(app: dict[str, Any]) -> None:
    parts = [{"type": "text", "text": ""}] * 100_000
    body = {"model": MODEL, "messages": [{"role": "user", "content": parts}]}
    r = httpx.post(f"{app['direct']}/v1/chat/completions", json=body, headers=_auth("alpha"), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_complex"


def _nothing_held(app: dict[str, Any]) -> bool:
    from ray import serve

    s = serve.get_deployment_handle(f"LLMServer-{MODEL}", app_name="mmserve").stats.remote().result()
    operator = {"Authorization": f"Bearer {OPERATOR_KEY}"}  # /stats is the operator's where keys are on
    cache = httpx.get(f"{app['direct']}/stats", headers=operator, timeout=30).json()[MODEL]
    return bool(
        s["num_running"] == 0
        and s["num_waiting"] == 0
        and s["num_free_blocks"] == s["num_total_blocks"]
        and cache["encoder_cache"]["reserved"] == 0
    )


def _long(stream: bool, content: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": LONG_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


def _stream_events(app: dict[str, Any]) -> list[dict[str, Any]]:
    image = [_image_part(make_image_bytes(64, 48, seed=21), None), {"type": "text", "text": "Go on."}]
    events = []
    with httpx.stream(
        "POST",
        f"{app['proxy']}/v1/chat/completions",
        json=_long(True, image),
        headers=_auth("beta"),
        timeout=60,
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    return events


def test_a_request_past_request_timeout_is_a_504_and_frees_what_it_held(app: dict[str, Any]) -> None:
    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(_stream_events, app)
        plain = httpx.post(
            f"{app['direct']}/v1/chat/completions",
            json=_long(False, "Count to a million."),
            headers=_auth("alpha"),
            timeout=60,
        )
        events = streamed.result()
    elapsed = time.monotonic() - start
    assert plain.status_code == 504 and plain.json()["error"]["code"] == "request_timeout", plain.text
    assert "request_timeout_s" in plain.json()["error"]["message"]
    assert "error" in events[-1] and events[-1]["error"]["code"] == "request_timeout"
    assert (
        sum(len(e["choices"][0]["delta"].get("content") or "") for e in events[:-1] if e.get("choices")) > 0
    )
    assert elapsed < TIMEOUT_S + 10
    wait_for(lambda: _nothing_held(app), 30, "the timed-out requests' KV blocks and reservations to be freed")


def test_keys_never_reach_a_log(app: dict[str, Any]) -> None:
    for path in Path(app["logs"]).rglob("*"):
        if path.is_file():
            text = path.read_bytes()
            assert all(key.encode() not in text for key in KEYS.values()), path
