"""E/P/D on one app over HTTP: the tiny Qwen2-VL with a prefill pool and a decode pool (`llm.pools`),
each its own Serve deployment; the KV of every request moves from the prefill replica to the decode
replica over their direct link. Answers equal transformers' greedy ``generate``; a three-turn chat
re-sending its image hits the prefill replica's prefix cache on its later turns (usage's
``cached_tokens`` is the prefill side's hit: the prompt is computed there; the decode replica's hit
shows as blocks it did not pull); the decode replica never fetches an embedding; no pin is left held.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.hf_oracle import hf_generate
from tests.integration.local_app import local_app
from tests.media import make_image_array, make_image_bytes

MODEL = "tiny-qwen2-vl"
BLOCK = 4
MAX_TOKENS = 12
_LOOP = asyncio.new_event_loop()  # Serve's handles run their router on the loop that made them


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    cache_dir = tmp_path_factory.mktemp("models")
    pool = {"num_replicas": 1, "num_cpus": 0.1}
    model = {
        "name": MODEL,
        "tiny": "qwen2-vl",
        "llm": {
            "max_model_len": 256,
            "block_size": BLOCK,
            "max_num_batched_tokens": 16,  # the prefill side's chunks cut through the images
            "num_kv_blocks": 128,
            "pools": [{"role": "prefill", "deployment": pool}, {"role": "decode", "deployment": pool}],
        },
        "encoder": {"cache_index_shards": 1},
        "preprocess": {"media": {"video_fps": 1.0}},
    }
    with local_app({"models": [model], "models_cache_dir": str(cache_dir)}, num_cpus=3) as client:
        yield {"client": client, "cache_dir": Path(cache_dir)}


def _image(w: int, h: int, seed: int) -> tuple[dict[str, Any], Any]:
    from PIL import Image

    url = "data:image/png;base64," + base64.b64encode(make_image_bytes(w, h, seed=seed)).decode()
    return {"type": "image_url", "image_url": {"url": url}}, Image.fromarray(
        make_image_array(w, h, seed=seed)
    )


def _stats(deployment: str) -> dict[str, Any]:
    """The pool's one replica's counters."""
    from ray import serve

    async def ask() -> dict[str, Any]:
        return dict(
            await serve.get_deployment_handle(f"{deployment}-{MODEL}", app_name="mmserve").stats.remote()
        )

    return _LOOP.run_until_complete(ask())


def _chat(client: OpenAI, messages: list[dict[str, Any]]) -> tuple[str, int, int]:
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert r.usage is not None
    details = r.usage.prompt_tokens_details
    cached = int(getattr(details, "cached_tokens", 0) or 0)
    return str(r.choices[0].message.content), r.usage.prompt_tokens, cached


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_answers_equal_hf(app: dict[str, Any], n_images: int) -> None:
    parts = [_image(64 + 28 * i, 56, seed=10 + i) for i in range(n_images)]
    text = "Describe what you see, then count to five."
    content = [p for p, _ in parts] + [{"type": "text", "text": text}]
    hf_content = [{"type": "image"} for _ in parts] + [{"type": "text", "text": text}]
    before = _stats("LLMDecodeServer")
    answer, _, _ = _chat(app["client"], [{"role": "user", "content": content}])
    media = {"images": [img for _, img in parts]} if parts else {}
    want = hf_generate(
        app["cache_dir"] / MODEL, [{"role": "user", "content": hf_content}], MAX_TOKENS, **media
    )
    assert answer == want
    after = _stats("LLMDecodeServer")
    assert after["kv_imports"] == before["kv_imports"] + 1  # decoded on the decode replica
    assert after["kv_blocks_pulled"] > before["kv_blocks_pulled"]
    assert after["skipped_embedding_fetches"] == 0  # it was never asked to fetch one


def test_video_equals_hf(app: dict[str, Any]) -> None:
    import numpy as np
    from transformers.video_utils import VideoMetadata

    from encoder_service.preprocess.media import MediaLimits
    from encoder_service.preprocess.media.video import decode_video, sample_frame_indices
    from tests.media import make_video_bytes

    mp4 = make_video_bytes(84, 56, num_frames=24, fps=8, seed=4)  # 3 s: 4 frames kept at 1 fps
    url = "data:video/mp4;base64," + base64.b64encode(mp4).decode()
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "what?"}]
    answer, _, _ = _chat(app["client"], [{"role": "user", "content": content}])
    frames, meta = decode_video(mp4, MediaLimits(video_fps=1.0), frame_multiple=2)
    indices = sample_frame_indices(meta["total_frames"], meta["sampled_frames"])
    hf_meta = VideoMetadata(total_num_frames=meta["total_frames"], fps=8.0, frames_indices=indices)
    videos = {"videos": [np.asarray(frames)], "video_metadata": [hf_meta], "do_sample_frames": False}
    hf_msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what?"}]}]
    assert answer == hf_generate(app["cache_dir"] / MODEL, hf_msgs, MAX_TOKENS, **videos)


def test_three_turn_chat_hits_the_prefill_replicas_cache(app: dict[str, Any]) -> None:
    part, img = _image(96, 64, 70)
    served: list[dict[str, Any]] = []
    hf_msgs: list[dict[str, Any]] = []
    prev_prompt = 0
    hits_before = _stats("LLMDecodeServer")["kv_blocks_hit"]
    for turn, question in enumerate(["What is this?", "And its colours?", "Anything else?"]):
        served.append(
            {"role": "user", "content": [part, {"type": "text", "text": question}] if turn == 0 else question}
        )
        hf_msgs.append(
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": question}] if turn == 0 else question,
            }
        )
        answer, prompt, cached = _chat(app["client"], served)
        assert answer == hf_generate(app["cache_dir"] / MODEL, hf_msgs, MAX_TOKENS, images=[img]), turn
        if turn:  # the previous turn's prompt (its full blocks) came from the prefill replica's cache
            assert cached >= prev_prompt // BLOCK * BLOCK, (turn, cached, prev_prompt)
        prev_prompt = prompt
        served.append({"role": "assistant", "content": answer})
        hf_msgs.append({"role": "assistant", "content": answer})
    # the decode replica registered the imported blocks under the same chained hashes: turns 2 and 3
    # found the earlier turns' blocks in its own prefix cache and did not pull them again
    assert _stats("LLMDecodeServer")["kv_blocks_hit"] > hits_before


def test_every_pin_ended_by_its_pull(app: dict[str, Any]) -> None:
    p, d = _stats("LLMPrefillServer"), _stats("LLMDecodeServer")
    assert p["kv_handoffs"] == p["kv_pulls"] == d["kv_imports"] > 0
    assert p["kv_expired"] == 0 and d["kv_failed_imports"] == 0
    assert p["num_running"] == p["num_waiting"] == 0
    assert d["num_running"] == d["num_waiting"] == 0
    n = d["kv_imports"]
    print(  # what a hand-off cost here (shown with -s; docs/disaggregation.md quotes a run)
        f"\nE/P/D tiny Qwen2-VL: {n:.0f} hand-offs, {d['kv_bytes_pulled'] / n / 2**20:.3f} MiB and "
        f"{d['kv_blocks_pulled'] / n:.1f} blocks pulled per request ({d['kv_blocks_hit']:.0f} blocks hit), "
        f"{1000 * d['kv_import_cpu_s'] / n:.2f} CPU-ms writing them per request"
    )
