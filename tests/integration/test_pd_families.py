"""E/P/D over HTTP for the families whose KV is more than one group of full-attention blocks, in ONE
app: the tiny Gemma 3 and Gemma 4 (a sliding-window block group: only the window's blocks move;
Gemma 4's KV-shared layers move nothing) and Qwen3.5 (hybrid: the linear-attention state moves with
the blocks), each with a prefill pool and a decode pool of one replica (`llm.pools`). Answers equal
transformers' greedy ``generate`` for text, one and two images, audio (Gemma 4) and video (Qwen3.5);
the prefill side's chunks cut through the prompts; a three-turn chat hits the prefill replica's
prefix cache on its later turns; two long generations outgrow the decode replica's KV pool, so it
preempts and recomputes from its own prefix cache; every pin ends by its pull.
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.hf_oracle import hf_generate, hf_unshared_tail
from tests.integration.local_app import local_app
from tests.media import make_audio_bytes, make_image_array, make_image_bytes, make_video_bytes

BLOCK = 4
MAX_TOKENS = 8
VIDEO_FPS = 1.0
_LOOP = asyncio.new_event_loop()  # Serve's handles run their router on the loop that made them


@dataclass(frozen=True)
class Family:
    tiny: str
    max_num_batched_tokens: int  # Gemma: an image's span is never cut, so a chunk holds one
    max_model_len: int = 160
    video: bool = False
    audio: bool = False

    @property
    def model(self) -> str:
        return f"tiny-{self.tiny}"


FAMILIES = [
    Family("gemma3", max_num_batched_tokens=24),
    Family("gemma4", max_num_batched_tokens=72, max_model_len=192, audio=True),
    Family("qwen3.5", max_num_batched_tokens=16, video=True),
]


def _model_config(f: Family) -> dict[str, Any]:
    pool = {"num_replicas": 1, "num_cpus": 0.1}
    return {
        "name": f.model,
        "tiny": f.tiny,
        "llm": {
            "max_model_len": f.max_model_len,
            "block_size": BLOCK,
            "max_num_batched_tokens": f.max_num_batched_tokens,
            "num_kv_blocks": f.max_model_len // BLOCK,  # both pools: two long generations do not fit
            "pools": [{"role": "prefill", "deployment": pool}, {"role": "decode", "deployment": pool}],
        },
        "encoder": {"cache_index_shards": 1},
        "preprocess": {
            "limit_mm_per_prompt": {
                "image": 2,
                **({"video": 1} if f.video else {}),
                **({"audio": 1} if f.audio else {}),
            },
            "media": {"video_fps": VIDEO_FPS},
        },
    }


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    cache_dir = tmp_path_factory.mktemp("models")
    config = {"models": [_model_config(f) for f in FAMILIES], "models_cache_dir": str(cache_dir)}
    with local_app(config, num_cpus=4) as client:
        yield {"client": client, "cache_dir": Path(cache_dir)}


def _image(w: int, h: int, seed: int) -> tuple[dict[str, Any], Any]:
    from PIL import Image

    url = "data:image/png;base64," + base64.b64encode(make_image_bytes(w, h, seed=seed)).decode()
    return {"type": "image_url", "image_url": {"url": url}}, Image.fromarray(
        make_image_array(w, h, seed=seed)
    )


def _stats(role: str, f: Family) -> dict[str, Any]:
    """The model's pool of ``role``'s one replica's counters."""
    from ray import serve

    name = {"prefill": "LLMPrefillServer", "decode": "LLMDecodeServer"}[role]

    async def ask() -> dict[str, Any]:
        return dict(await serve.get_deployment_handle(f"{name}-{f.model}", app_name="mmserve").stats.remote())

    return _LOOP.run_until_complete(ask())


def _chat(
    client: OpenAI, f: Family, messages: list[dict[str, Any]], n: int = MAX_TOKENS
) -> tuple[str, int, int]:
    r = client.chat.completions.create(model=f.model, messages=messages, max_tokens=n, temperature=0)
    assert r.usage is not None
    cached = int(getattr(r.usage.prompt_tokens_details, "cached_tokens", 0) or 0)
    return str(r.choices[0].message.content), r.usage.prompt_tokens, cached


def _hf(
    app: dict[str, Any], f: Family, content: list[dict[str, Any]], n: int = MAX_TOKENS, **media: Any
) -> str:
    return hf_generate(app["cache_dir"] / f.model, [{"role": "user", "content": content}], n, **media)


@pytest.mark.parametrize("f", FAMILIES, ids=lambda f: f.tiny)
def test_text_and_images_equal_hf(app: dict[str, Any], f: Family) -> None:
    client = app["client"]
    before = _stats("decode", f)
    text = "hello there, tell me more"
    assert _chat(client, f, [{"role": "user", "content": text}])[0] == _hf(
        app, f, [{"type": "text", "text": text}]
    )
    parts, images = zip(*(_image(w, h, s) for w, h, s in [(96, 64, 31), (56, 120, 32)]), strict=True)
    for n in (1, 2):
        served, _, _ = _chat(
            client, f, [{"role": "user", "content": [*parts[:n], {"type": "text", "text": "Compare."}]}]
        )
        hf_content = [*[{"type": "image"}] * n, {"type": "text", "text": "Compare."}]
        assert served == _hf(app, f, hf_content, images=list(images[:n])), n
    after = _stats("decode", f)
    assert after["kv_imports"] == before["kv_imports"] + 3  # every answer decoded on the decode replica
    assert after["skipped_embedding_fetches"] == 0


@pytest.mark.parametrize("f", [f for f in FAMILIES if f.audio], ids=lambda f: f.tiny)
def test_audio_equals_hf(app: dict[str, Any], f: Family) -> None:
    import soundfile as sf

    wav = make_audio_bytes(1.2, freq=330.0, seed=5)
    clip = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    served, _, _ = _chat(
        app["client"], f, [{"role": "user", "content": [clip, {"type": "text", "text": "What is it?"}]}]
    )
    waveform = sf.read(io.BytesIO(wav), dtype="float32")[0]
    hf_content = [{"type": "audio"}, {"type": "text", "text": "What is it?"}]
    assert served == _hf(app, f, hf_content, audio=[waveform])


@pytest.mark.parametrize("f", [f for f in FAMILIES if f.video], ids=lambda f: f.tiny)
def test_video_equals_hf(app: dict[str, Any], f: Family) -> None:
    import numpy as np
    from transformers.video_utils import VideoMetadata

    from encoder_service.preprocess.media import MediaLimits
    from encoder_service.preprocess.media.video import decode_video, sample_frame_indices

    mp4 = make_video_bytes(84, 56, num_frames=24, fps=8, seed=4)  # 3 s: 4 frames kept at 1 fps
    url = "data:video/mp4;base64," + base64.b64encode(mp4).decode()
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "what?"}]
    served, _, _ = _chat(app["client"], f, [{"role": "user", "content": content}])
    frames, meta = decode_video(mp4, MediaLimits(video_fps=VIDEO_FPS), frame_multiple=2)
    indices = sample_frame_indices(meta["total_frames"], meta["sampled_frames"])
    hf_meta = VideoMetadata(total_num_frames=meta["total_frames"], fps=8.0, frames_indices=indices)
    videos = {"videos": [np.asarray(frames)], "video_metadata": [hf_meta], "do_sample_frames": False}
    assert served == _hf(app, f, [{"type": "video"}, {"type": "text", "text": "what?"}], **videos)


@pytest.mark.parametrize("f", FAMILIES, ids=lambda f: f.tiny)
def test_three_turn_chat_hits_the_prefill_replicas_cache(app: dict[str, Any], f: Family) -> None:
    """Each turn re-sends the conversation with its image; its later turns find the previous turn's
    prompt (its full blocks; Qwen3.5: and the state snapshot at its end) in the prefill replica's
    prefix cache: usage's ``cached_tokens`` is that prefill-side hit (the prompt is computed there).
    Where the released template writes a past answer without its generation prompt's opener (Gemma 4's
    empty thought channel, Qwen3.5's ``<think>``): the previous prompt less those tokens; a hybrid's
    snapshot then sits past where the prompts part, so it has no bound."""
    part, img = _image(96, 64, 70)
    served: list[dict[str, Any]] = []
    hf_msgs: list[dict[str, Any]] = []
    prev_prompt, prev_msgs = 0, []  # the previous turn's prompt tokens (served) and messages (HF's)
    for turn, question in enumerate(["What is this?", "And its colours?", "Anything else?"]):
        first = turn == 0
        served.append(
            {"role": "user", "content": [part, {"type": "text", "text": question}] if first else question}
        )
        hf_msgs.append(
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": question}] if first else question,
            }
        )
        answer, prompt, cached = _chat(app["client"], f, served)
        assert answer == hf_generate(app["cache_dir"] / f.model, hf_msgs, MAX_TOKENS, images=[img]), turn
        drop = hf_unshared_tail(app["cache_dir"] / f.model, prev_msgs, hf_msgs) if turn else 0
        if turn and not (drop and f.tiny == "qwen3.5"):
            assert cached >= (prev_prompt - drop) // BLOCK * BLOCK > 0, (turn, cached, prev_prompt, drop)
        prev_prompt, prev_msgs = prompt, list(hf_msgs)
        served.append({"role": "assistant", "content": answer})
        hf_msgs.append({"role": "assistant", "content": answer})


@pytest.mark.parametrize("f", FAMILIES, ids=lambda f: f.tiny)
def test_decode_side_preemption_equals_hf(app: dict[str, Any], f: Family) -> None:
    """Two text requests of about 0.35 of the KV pool each, generating another 0.3: both are imported,
    their decodes outgrow the decode replica's pool, one is preempted and recomputed there from its
    prefix cache (text only: the decode side never fetches embeddings)."""
    before = _stats("decode", f)["num_preemptions"]
    n = f.max_model_len * 3 // 10
    words = f.max_model_len * 3 // 10
    texts = [f"Story {i}: " + " ".join(f"w{(7 * i + k) % 50}" for k in range(words)) for i in range(2)]
    with ThreadPoolExecutor(2) as pool:
        served = list(
            pool.map(lambda t: _chat(app["client"], f, [{"role": "user", "content": t}], n)[0], texts)
        )
    assert _stats("decode", f)["num_preemptions"] > before
    for text, got in zip(texts, served, strict=True):
        assert got == _hf(app, f, [{"type": "text", "text": text}], n), text


def test_every_pin_ended_by_its_pull(app: dict[str, Any]) -> None:
    for f in FAMILIES:
        p, d = _stats("prefill", f), _stats("decode", f)
        assert p["kv_handoffs"] == p["kv_pulls"] == d["kv_imports"] > 0, f.tiny
        assert p["kv_expired"] == 0 and d["kv_failed_imports"] == 0, f.tiny
        assert p["num_running"] == p["num_waiting"] == d["num_running"] == d["num_waiting"] == 0, f.tiny
        n = d["kv_imports"]
        print(  # what a hand-off cost here (shown with -s; docs/disaggregation.md quotes a run)
            f"\nE/P/D {f.model}: {n:.0f} hand-offs, {d['kv_bytes_pulled'] / n / 2**20:.4f} MiB and "
            f"{d['kv_blocks_pulled'] / n:.1f} blocks pulled per request ({d['kv_blocks_hit']:.0f} blocks hit), "
            f"{1000 * d['kv_import_cpu_s'] / n:.2f} CPU-ms writing them per request"
        )
