"""Every modality through the openai client and real HTTP; greedy answers equal transformers' own
`generate(do_sample=False)` on the same model directory and the same decoded media."""

from __future__ import annotations

import asyncio
import base64
import io
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError, OpenAI
from PIL import Image

from tests.integration.e2e.common import (
    AUDIO,
    MAX_TOKENS,
    PORT,
    VL,
    ask,
    data_url,
    hf_generate,
)
from tests.media import make_audio_bytes, make_image_bytes, make_video_bytes

pytestmark = pytest.mark.usefixtures("app")  # the package's one app (conftest.py)


def test_models_and_health(client: OpenAI) -> None:
    assert sorted(m.id for m in client.models.list().data) == [AUDIO, VL]
    assert httpx.get(f"http://127.0.0.1:{PORT}/health").json() == {"status": "ok"}
    # KubeRay's readiness probe of a serving pod: `wget -q -O- localhost:<serve port>/-/healthz | grep success`
    probe = httpx.get(f"http://127.0.0.1:{PORT}/-/healthz")
    assert (probe.status_code, probe.text) == (200, "success")


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
    from encoder_service.preprocess.media.limits import MediaLimits
    from encoder_service.preprocess.media.loader import load_media_sync
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

    from encoder_service.preprocess.media.limits import MediaLimits
    from encoder_service.preprocess.media.loader import load_media_sync
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
