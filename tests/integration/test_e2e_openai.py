"""The whole app on Ray Serve, driven by the real `openai` client; answers checked against HF generate.

One app per module (Ray + Serve start once). Greedy answers must equal transformers' own
`generate(do_sample=False)` on the same model directory and the same decoded media.
The `test_zz*` tests kill an encoder replica, then delete the app: keep them last in the file.
Ray exports the app's Prometheus metrics on a fixed local port, every second (see the fixture).
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import APITimeoutError, AsyncOpenAI, BadRequestError, NotFoundError, OpenAI
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from tests.hf_oracle import hf_generate as oracle_generate
from tests.media import make_audio_bytes, make_image_bytes, make_video_bytes

PORT = 8431
MAX_TOKENS = 8
VL, AUDIO = "tiny-qwen2-vl", "tiny-qwen2-audio"


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import ray
    from ray import serve

    from cluster.config import AppConfig, default_config
    from cluster.serve_cli import start

    cache_dir = tmp_path_factory.mktemp("models")
    cfg = default_config().model_dump()
    cfg.update(port=PORT, models_cache_dir=str(cache_dir))
    for m in cfg["models"]:
        m["preprocess"]["media"]["allow_private_addresses"] = True  # the test's HTTP server is on loopback
        m["preprocess"]["limit_mm_per_prompt"] = {"image": 2, "video": 1, "audio": 1}
    # start() would call the same ray.init; here Ray's metrics agent also serves Prometheus text on a
    # known port, and workers push their metrics every second instead of every ten.
    metrics_port = _free_port()
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        namespace="mmserve",
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    start(AppConfig.model_validate(cfg))
    yield {
        "dirs": {VL: cache_dir / "tiny-qwen2-vl", AUDIO: cache_dir / "tiny-qwen2-audio"},
        "metrics_url": f"http://127.0.0.1:{metrics_port}/metrics",
    }
    serve.shutdown()
    ray.shutdown()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def client(app: dict[str, Any]) -> OpenAI:
    return OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def media_server() -> Iterator[str]:
    files = {"/cat.png": make_image_bytes(96, 64, seed=5)}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = files.get(self.path)
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


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


def test_models_and_health(client: OpenAI) -> None:
    assert sorted(m.id for m in client.models.list().data) == [AUDIO, VL]
    assert httpx.get(f"http://127.0.0.1:{PORT}/health").json() == {"status": "ok"}


def test_text_matches_hf(client: OpenAI, app: dict[str, Any]) -> None:
    r = ask(client, VL, "Tell me about the weather.")
    expected = hf_generate(app["dirs"][VL], [{"role": "user", "content": "Tell me about the weather."}])
    assert r.choices[0].message.content == expected
    assert r.usage.completion_tokens == MAX_TOKENS or r.choices[0].finish_reason == "stop"


def test_image_data_url_and_streaming_match_hf(client: OpenAI, app: dict[str, Any]) -> None:
    png = make_image_bytes(64, 48, seed=1)
    content: list[Any] = [
        {"type": "image_url", "image_url": {"url": data_url(png, "image/png")}},
        {"type": "text", "text": "Describe."},
    ]
    expected = hf_generate(
        app["dirs"][VL],
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}],
        images=[Image.open(io.BytesIO(png)).convert("RGB")],
    )
    assert ask(client, VL, content).choices[0].message.content == expected
    chunks = list(
        client.chat.completions.create(
            model=VL,
            messages=[{"role": "user", "content": content}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 16
    # The second request reused the first one's KV blocks, image included.
    details = chunks[-1].usage.prompt_tokens_details
    assert details is not None and (details.cached_tokens or 0) >= 16


def test_two_images_one_by_http_url(client: OpenAI, app: dict[str, Any], media_server: str) -> None:
    jpg = make_image_bytes(56, 84, fmt="JPEG", seed=2)
    content = [
        {"type": "image_url", "image_url": {"url": f"{media_server}/cat.png"}},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": data_url(jpg, "image/jpeg")}},
    ]
    expected = hf_generate(
        app["dirs"][VL],
        [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}],
            }
        ],
        images=[
            Image.open(io.BytesIO(make_image_bytes(96, 64, seed=5))).convert("RGB"),
            Image.open(io.BytesIO(jpg)).convert("RGB"),
        ],
    )
    assert ask(client, VL, content).choices[0].message.content == expected


def test_video_matches_hf(client: OpenAI, app: dict[str, Any]) -> None:
    from encoder_service.media.limits import MediaLimits
    from encoder_service.media.loader import load_media_sync
    from encoder_service.types import MediaRef

    mp4 = make_video_bytes(width=56, height=56, num_frames=8, fps=4)
    content = [
        {"type": "video_url", "video_url": {"url": data_url(mp4, "video/mp4")}},
        {"type": "text", "text": "What?"},
    ]
    frames = load_media_sync(MediaRef("video", data=mp4), MediaLimits(), frame_multiple=2).value
    expected = hf_generate(
        app["dirs"][VL],
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What?"}]}],
        videos=[frames],
    )
    assert ask(client, VL, content).choices[0].message.content == expected


def test_audio_matches_hf(client: OpenAI, app: dict[str, Any]) -> None:
    import librosa

    wav = make_audio_bytes(seconds=1.5, sr=22050)
    content = [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    ]
    audio, _ = librosa.load(io.BytesIO(wav), sr=16000)
    expected = hf_generate(
        app["dirs"][AUDIO],
        [{"role": "user", "content": [{"type": "audio"}]}],
        audio=[audio],
        sampling_rate=16000,
    )
    assert ask(client, AUDIO, content).choices[0].message.content == expected


def test_32_concurrent_streams_mixing_modalities(client: OpenAI, app: dict[str, Any]) -> None:
    """Images (repeated), a video and audio clips, 32 streams at once; each distinct item encoded once."""
    import librosa

    from encoder_service.media.limits import MediaLimits
    from encoder_service.media.loader import load_media_sync
    from encoder_service.types import MediaRef

    images = [make_image_bytes(56 + 28 * (i % 2), 56, seed=100 + i) for i in range(4)]
    mp4 = make_video_bytes(width=56, height=56, num_frames=4, fps=4, seed=7)
    wavs = [make_audio_bytes(seconds=1.0, freq=300.0 + 100 * i, seed=i) for i in range(2)]
    cases: list[tuple[str, list[Any], str]] = []  # (model, openai content, expected)
    for k, png in enumerate(images):
        cases.append(
            (
                VL,
                [
                    {"type": "image_url", "image_url": {"url": data_url(png, "image/png")}},
                    {"type": "text", "text": f"Item {k}"},
                ],
                hf_generate(
                    app["dirs"][VL],
                    [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Item {k}"}]}],
                    images=[Image.open(io.BytesIO(png)).convert("RGB")],
                ),
            )
        )
    frames = load_media_sync(MediaRef("video", data=mp4), MediaLimits(), frame_multiple=2).value
    cases.append(
        (
            VL,
            [{"type": "video_url", "video_url": {"url": data_url(mp4, "video/mp4")}}],
            hf_generate(app["dirs"][VL], [{"role": "user", "content": [{"type": "video"}]}], videos=[frames]),
        )
    )
    for wav in wavs:
        audio, _ = librosa.load(io.BytesIO(wav), sr=16000)
        cases.append(
            (
                AUDIO,
                [
                    {
                        "type": "input_audio",
                        "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"},
                    }
                ],
                hf_generate(
                    app["dirs"][AUDIO],
                    [{"role": "user", "content": [{"type": "audio"}]}],
                    audio=[audio],
                    sampling_rate=16000,
                ),
            )
        )
    stats_url = f"http://127.0.0.1:{PORT}/stats"
    before = {m: v["encoder_items_dispatched"] for m, v in httpx.get(stats_url).json().items()}
    aclient = AsyncOpenAI(
        base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", timeout=300, max_retries=0
    )

    async def one(i: int) -> tuple[int, str]:
        model, content, _ = cases[i % len(cases)]
        stream = await aclient.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": content}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
        return i % len(cases), "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run_all() -> list[tuple[int, str]]:
        return await asyncio.gather(*(one(i) for i in range(32)))

    for k, text in asyncio.run(run_all()):
        assert text == cases[k][2], k
    after = {m: v["encoder_items_dispatched"] for m, v in httpx.get(stats_url).json().items()}
    assert after[VL] - before[VL] == len(images) + 1  # every distinct item encoded exactly once
    assert after[AUDIO] - before[AUDIO] == len(wavs)


def test_second_turn_about_the_same_image_hits_the_prefix_cache(client: OpenAI) -> None:
    png = make_image_bytes(84, 56, seed=77)
    turn1: list[Any] = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(png, "image/png")}},
                {"type": "text", "text": "What is it?"},
            ],
        }
    ]
    first = client.chat.completions.create(model=VL, messages=turn1, max_tokens=MAX_TOKENS, temperature=0)
    turn2: list[Any] = [
        *turn1,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And its colour?"},
    ]
    second = client.chat.completions.create(model=VL, messages=turn2, max_tokens=MAX_TOKENS, temperature=0)
    details = second.usage.prompt_tokens_details if second.usage else None
    assert details is not None and (details.cached_tokens or 0) > 16  # past the system prompt: image blocks


def test_uuid_served_from_cache_and_miss_is_a_named_400(client: OpenAI, app: dict[str, Any]) -> None:
    png = make_image_bytes(64, 64, seed=9)
    with_data = [{"type": "image_url", "image_url": {"url": data_url(png, "image/png")}, "uuid": "img-9"}]
    first = ask(client, VL, with_data)
    by_uuid = ask(client, VL, [{"type": "image_url", "uuid": "img-9"}])
    assert by_uuid.choices[0].message.content == first.choices[0].message.content
    with pytest.raises(BadRequestError) as e:
        ask(client, VL, [{"type": "image_url", "uuid": "never-sent"}])
    body: Any = e.value.body
    assert body["code"] == "mm_cache_miss" and "never-sent" in body["message"]


@pytest.mark.parametrize(
    ("model", "content", "status", "code"),
    [
        (
            VL,
            [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}] * 3,
            400,
            "too_many_items",
        ),
        (
            VL,
            [{"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}],
            None,
            None,
        ),
        (
            VL,
            [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}],
            400,
            "unsupported_modality",
        ),
        (
            AUDIO,
            [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}],
            400,
            "unsupported_modality",
        ),
        (VL, [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}], 403, "url_not_allowed"),
    ],
)
def test_client_errors_are_4xx(model: str, content: Any, status: int | None, code: str | None) -> None:
    r = httpx.post(
        f"http://127.0.0.1:{PORT}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4},
        timeout=60,
    )
    assert 400 <= r.status_code < 500, r.text
    if status is not None:
        assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    assert r.json()["error"]["message"]


def test_unknown_model_and_bad_params() -> None:
    c = OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0)
    with pytest.raises(NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(BadRequestError):
        c.chat.completions.create(model=VL, messages=[{"role": "user", "content": "x"}], temperature=5)
    with pytest.raises(BadRequestError) as e:
        c.chat.completions.create(model=VL, messages=[{"role": "user", "content": "x"}], max_tokens=100000)
    body: Any = e.value.body
    assert "max_model_len" in body["message"]


def _wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.2)


LONG = 3500  # max_tokens of the generations a client abandons (ignore_eos: it would run to the end)
GENERATED = "ray_mmserve_generated_tokens_total"


def _metric(app: dict[str, Any], sample: str, model: str) -> float:
    """One Prometheus sample summed over every worker exporting it, for one model (0 when absent)."""
    text = httpx.get(app["metrics_url"], timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == sample and s.labels.get("model") == model
    )


def _llm_stats(model: str = VL) -> dict[str, Any]:
    from ray import serve

    handle = serve.get_deployment_handle(f"LLMServer-{model}", app_name="mmserve")
    return dict(handle.stats.remote().result(timeout_s=30))


def _encoder_cache(model: str = VL) -> dict[str, Any]:
    return dict(httpx.get(f"http://127.0.0.1:{PORT}/stats").json()[model]["encoder_cache"])


def _nothing_held() -> bool:
    """The LLM replica runs and queues nothing, every KV block is free, no encoder-cache entry is pinned."""
    s = _llm_stats()
    return (
        s["num_running"] == 0
        and s["num_waiting"] == 0
        and s["num_free_blocks"] == s["num_total_blocks"]
        and _encoder_cache()["pinned"] == 0
    )


def _image_chat(png: bytes, text: str) -> list[dict[str, Any]]:
    content = [
        {"type": "image_url", "image_url": {"url": data_url(png, "image/png")}},
        {"type": "text", "text": text},
    ]
    return [{"role": "user", "content": content}]


def _tokens_generated_since(client: OpenAI, app: dict[str, Any], before: float, seen: int = 0) -> float:
    """About how many tokens the VL replica streamed since ``before`` (a reading of its counter), for
    an upper bound. A short marker request goes last; the counter is read once it shows ``seen`` (the
    tokens the client saw) plus the marker's. Workers export once a second, so the figure is rough:
    good to tell a few dozen tokens from the thousands of a generation nobody stopped."""
    marker = client.chat.completions.create(
        model=VL,
        messages=[{"role": "user", "content": "marker"}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert marker.usage is not None and marker.usage.completion_tokens == MAX_TOKENS
    _wait_for(
        lambda: _metric(app, GENERATED, VL) >= before + seen + MAX_TOKENS,
        20.0,
        "the marker's tokens in /metrics",
    )
    return _metric(app, GENERATED, VL) - before - MAX_TOKENS


def test_metrics_report_real_values(client: OpenAI, app: dict[str, Any]) -> None:
    """Known traffic (two fresh images, a streamed and a plain request) shows up in Ray's Prometheus
    export: generated tokens, encoded items, TTFT and e2e histogram counts, all for the VL model."""
    samples = (
        GENERATED,
        "ray_mmserve_encoder_items_total",
        "ray_mmserve_ttft_seconds_count",
        "ray_mmserve_e2e_latency_seconds_count",
    )
    before = {s: _metric(app, s, VL) for s in samples}
    plain = client.chat.completions.create(
        model=VL,
        messages=_image_chat(make_image_bytes(56, 56, seed=601), "Count."),
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    chunks = list(
        client.chat.completions.create(
            model=VL,
            messages=_image_chat(make_image_bytes(84, 56, seed=602), "Count."),
            max_tokens=MAX_TOKENS + 3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert plain.usage is not None and chunks[-1].usage is not None
    completion = plain.usage.completion_tokens + chunks[-1].usage.completion_tokens
    assert completion == 2 * MAX_TOKENS + 3
    expected = dict(zip(samples, (completion, 2, 2, 2), strict=True))

    def exported() -> bool:
        return all(_metric(app, s, VL) - before[s] >= n for s, n in expected.items())

    _wait_for(exported, 20.0, f"{expected} more in {app['metrics_url']}")
    # Each model's encoder counts what the ingress dispatched to that model's pool (exports only lag):
    # no item is counted twice or under the other model's label.
    dispatched = httpx.get(f"http://127.0.0.1:{PORT}/stats").json()
    for model in (VL, AUDIO):
        assert (
            _metric(app, "ray_mmserve_encoder_items_total", model)
            <= dispatched[model]["encoder_items_dispatched"]
        )


def test_streamed_client_disconnect_aborts_the_generation(client: OpenAI, app: dict[str, Any]) -> None:
    """A client reads a few chunks of a long generation about a fresh image and hangs up: the engine
    drops the request (its KV blocks all free again) long before max_tokens, and no pin is left."""
    before = _metric(app, GENERATED, VL)
    stream = client.chat.completions.create(
        model=VL,
        messages=_image_chat(make_image_bytes(98, 70, seed=611), "Go on forever."),
        max_tokens=LONG,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = 0
    for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
        if seen == 4:
            break
    mid = _llm_stats()
    assert mid["num_running"] == 1 and mid["num_free_blocks"] < mid["num_total_blocks"]  # still generating
    stream.close()  # closes the HTTP connection mid-stream

    _wait_for(_nothing_held, 20.0, "the LLM replica to drop the abandoned stream and the pins to go")
    generated = _tokens_generated_since(client, app, before, seen)
    assert generated < LONG // 4, generated


@pytest.mark.parametrize("timeout_s", [0.05, 0.5])
def test_non_streamed_client_timeout_aborts_the_generation(
    client: OpenAI, app: dict[str, Any], timeout_s: float
) -> None:
    """A plain request about a fresh image whose client gives up (read timeout) on a long generation:
    same guarantees. After 0.05 s it is mostly gone before the first token (preprocessing or
    encoding, pins held), after 0.5 s mid-generation."""
    before = _metric(app, GENERATED, VL)
    impatient = OpenAI(
        base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", timeout=timeout_s, max_retries=0
    )
    with pytest.raises(APITimeoutError):
        impatient.chat.completions.create(
            model=VL,
            messages=_image_chat(make_image_bytes(70, 98, seed=612 + int(timeout_s * 100)), "Go on forever."),
            max_tokens=LONG,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    impatient.close()

    _wait_for(_nothing_held, 20.0, "the LLM replica to drop the abandoned request and the pins to go")
    generated = _tokens_generated_since(client, app, before)
    assert generated < LONG // 4, generated


def test_zz_embeddings_lost_with_their_encoder_replica_are_encoded_again(
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
        prefix = f"SERVE_REPLICA::mmserve#EncoderPool-{VL}#"
        return [
            a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)
        ]

    before = stats()
    (victim,) = encoder_replicas()  # one replica: the one that computed the image
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)

    def replaced() -> bool:
        names = encoder_replicas()
        deployment = serve.status().applications["mmserve"].deployments[f"EncoderPool-{VL}"]
        running = deployment.replica_states.get("RUNNING", 0)
        return victim not in names and len(names) == 1 and running == 1 and deployment.status == "HEALTHY"

    _wait_for(replaced, 25.0, "Serve to replace the killed encoder replica")
    assert ask(client, VL, content).choices[0].message.content == expected
    after = stats()
    assert after["encoder_items_dispatched"] - before["encoder_items_dispatched"] == 1  # encoded again
    assert after["encoder_cache"]["invalidations"] - before["encoder_cache"]["invalidations"] == 1
    assert after["encoder_cache"]["pinned"] == 0


def test_zzz_graceful_encoder_shutdown_invalidates_what_it_owns(client: OpenAI) -> None:
    """Serve runs each replica's ``__del__`` on graceful shutdown; the encoder replica's drops the
    cache entries holding its objects. Deletes the app, so it runs last (the fixture then shuts down)."""
    from ray import serve

    from cluster.config import default_config
    from router.deployment import cache_index_args, open_cache_index

    png = make_image_bytes(42, 70, seed=405)
    ask(client, VL, [{"type": "image_url", "image_url": {"url": data_url(png, "image/png")}}])
    before = httpx.get(f"http://127.0.0.1:{PORT}/stats").json()[VL]["encoder_cache"]
    serve.delete("mmserve")  # graceful: drains, then __del__ on every replica
    (model,) = [m for m in default_config().models if m.name == VL]
    after = asyncio.run(open_cache_index(*cache_index_args(model)).stats())
    dropped = after["invalidations"] - before["invalidations"]
    assert dropped >= 1  # at least the image just encoded
    assert before["entries"] - after["entries"] == dropped and after["pinned"] == 0
