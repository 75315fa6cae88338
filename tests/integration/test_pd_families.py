"""E/P/D over HTTP for every served family, in two apps: the tiny Gemma 3 and Gemma 4 (a sliding-window
block group: only the window's blocks move; Gemma 4's KV-shared layers move nothing) and Qwen3.5
(hybrid: the linear-attention state moves with the blocks); then Qwen2-VL, Qwen2.5-VL, Qwen3-VL
(DeepStack) and Qwen2-Audio. Each model has a prefill pool and a decode pool of one replica
(`llm.pools`), each its own Serve deployment; the KV of every request moves from the prefill replica
to the decode replica over their direct link, and the decode replica never fetches an embedding.
Answers equal transformers' greedy ``generate`` for text, one and two images, audio and video where
the family takes them; the prefill side's chunks cut through the prompts; a three-turn chat hits the
prefill replica's prefix cache on its later turns (and, for the one-group families, the decode
replica's own: the imported blocks are registered under the same chained hashes); two long
generations outgrow the decode replica's KV pool, so it preempts and recomputes from its own prefix
cache, and two with media, which it swaps to host memory and back; every pin ends by its pull.
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
    max_num_batched_tokens: int = 16  # Gemma: an image's span is never cut, so a chunk holds one
    max_model_len: int = 160
    images: bool = True
    video: bool = False
    audio: bool = False
    # a later turn's prefill-side hit reaches the previous prompt's last full block (Gemma 4: its
    # template drops the generation prompt's thought channel from the history, and the next turn
    # shares 79 of the first turn's 99 tokens: a hit of 76)
    full_hit: bool = True
    # a later turn finds the earlier turns' imported blocks in the decode replica's own prefix cache
    # (it pulls only the rest): the families whose KV is one group of full-attention blocks
    decode_hit: bool = False
    llm: tuple[tuple[str, Any], ...] = ()  # more `llm` settings
    prefill_engine: tuple[tuple[str, Any], ...] = ()  # the prefill pool's own (llm.pools[].engine)

    @property
    def model(self) -> str:
        return f"tiny-{self.tiny}"


# Two apps, one after the other (each of its families' three pools at once is what this machine holds):
# the families whose KV is more than one group of full-attention blocks, then the Qwen families whose
# KV is that one group.
CHUNKS = (("kv_pull_chunks", True),)  # this app's pulls overlap the prefill, chunk by chunk
APPS = {
    "window-and-hybrid": [
        Family("gemma3", max_num_batched_tokens=24, llm=CHUNKS),
        # 256: two of its image prompts (119 tokens: its images take 60 whatever their size) in its pool
        Family(
            "gemma4", max_num_batched_tokens=72, max_model_len=256, audio=True, full_hit=False, llm=CHUNKS
        ),
        # Qwen3.5: its template drops the generation prompt's `<think>\n` (7 tiny-tokenizer tokens) from
        # the history, so a next turn leaves the previous prompt before the snapshots at its end; a
        # snapshot every 4 blocks (16 tokens) gives it a hit below that (docs/disaggregation.md)
        Family("qwen3.5", video=True, full_hit=False, llm=(("snapshot_interval_blocks", 4), *CHUNKS)),
    ],
    "full-attention": [
        # its prefill pool one block short of a whole max_model_len (the decode pool's 40): a request
        # whose prompt + max_tokens fills max_model_len is the prefill side's 400, nothing shorter is
        Family(
            "qwen2-vl", video=True, decode_hit=True, prefill_engine=(("num_kv_blocks", 160 // BLOCK - 1),)
        ),
        Family("qwen2.5-vl", video=True, decode_hit=True),
        Family("qwen3-vl", video=True, decode_hit=True),
        Family("qwen2-audio", images=False, audio=True, decode_hit=True),
    ],
}


def _model_config(f: Family) -> dict[str, Any]:
    pool = {"num_replicas": 1, "num_cpus": 0.1}
    limits = {"image": 2 if f.images else 0, "video": int(f.video), "audio": int(f.audio)}
    return {
        "name": f.model,
        "tiny": f.tiny,
        "llm": {
            "max_model_len": f.max_model_len,
            "block_size": BLOCK,
            "max_num_batched_tokens": f.max_num_batched_tokens,
            "num_kv_blocks": f.max_model_len // BLOCK,  # both pools: two long generations do not fit
            "pools": [
                {"role": "prefill", "deployment": pool, "engine": dict(f.prefill_engine)},
                {"role": "decode", "deployment": pool},
            ],
            **dict(f.llm),
        },
        "encoder": {"cache_index_shards": 1},
        "preprocess": {
            "limit_mm_per_prompt": {k: v for k, v in limits.items() if v},
            "media": {"video_fps": VIDEO_FPS},
        },
    }


@pytest.fixture(scope="module", params=list(APPS))
def app(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    families = APPS[request.param]
    cache_dir = tmp_path_factory.mktemp("models")
    config = {"models": [_model_config(f) for f in families], "models_cache_dir": str(cache_dir)}
    with local_app(config, num_cpus=4) as client:
        yield {"client": client, "cache_dir": Path(cache_dir), "families": families}


def _image(w: int, h: int, seed: int) -> tuple[dict[str, Any], Any]:
    from PIL import Image

    url = "data:image/png;base64," + base64.b64encode(make_image_bytes(w, h, seed=seed)).decode()
    return {"type": "image_url", "image_url": {"url": url}}, Image.fromarray(
        make_image_array(w, h, seed=seed)
    )


def _clip(f: Family, seconds: float, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """An audio content part and what transformers' processor takes for it (Qwen2-Audio's at 16 kHz)."""
    import librosa

    wav = make_audio_bytes(seconds, freq=330.0, seed=seed)
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    if f.tiny == "qwen2-audio":
        return part, {"audio": [librosa.load(io.BytesIO(wav), sr=16000)[0]], "sampling_rate": 16000}
    import soundfile as sf

    return part, {"audio": [sf.read(io.BytesIO(wav), dtype="float32")[0]]}


def _item(
    f: Family, seed: int, size: tuple[int, int] = (96, 64), seconds: float = 1.2
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A media part the family takes: served, its HF content part, its HF media."""
    if f.images:
        part, img = _image(*size, seed)
        return part, {"type": "image"}, {"images": [img]}
    part, media = _clip(f, seconds, seed)
    return part, {"type": "audio"}, media


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


def test_text_and_images_equal_hf(app: dict[str, Any]) -> None:
    client = app["client"]
    for f in app["families"]:
        before = _stats("decode", f)
        text = "hello there, tell me more"
        served, _, _ = _chat(client, f, [{"role": "user", "content": text}])
        assert served == _hf(app, f, [{"type": "text", "text": text}]), f.tiny
        asked = 1
        if f.images:
            parts, images = zip(*(_image(w, h, s) for w, h, s in [(96, 64, 31), (56, 120, 32)]), strict=True)
            for n in (1, 2):
                content = [*parts[:n], {"type": "text", "text": "Compare."}]
                served, _, _ = _chat(client, f, [{"role": "user", "content": content}])
                hf_content = [*[{"type": "image"}] * n, {"type": "text", "text": "Compare."}]
                assert served == _hf(app, f, hf_content, images=list(images[:n])), (f.tiny, n)
                asked += 1
        after = _stats("decode", f)
        assert after["kv_imports"] == before["kv_imports"] + asked, (
            f.tiny
        )  # all decoded on the decode replica
        assert after["kv_blocks_pulled"] > before["kv_blocks_pulled"], f.tiny
        assert after["skipped_embedding_fetches"] == 0, f.tiny  # it was never asked to fetch one


def test_audio_equals_hf(app: dict[str, Any]) -> None:
    for f in [f for f in app["families"] if f.audio]:
        part, media = _clip(f, 1.2, 5)
        served, _, _ = _chat(
            app["client"], f, [{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}]
        )
        assert served == _hf(app, f, [{"type": "audio"}, {"type": "text", "text": "What is it?"}], **media), (
            f.tiny
        )


def test_video_equals_hf(app: dict[str, Any]) -> None:
    import numpy as np
    from transformers.video_utils import VideoMetadata

    from encoder_service.preprocess.media import MediaLimits
    from encoder_service.preprocess.media.video import decode_video, sample_frame_indices

    mp4 = make_video_bytes(84, 56, num_frames=24, fps=8, seed=4)  # 3 s: 4 frames kept at 1 fps
    url = "data:video/mp4;base64," + base64.b64encode(mp4).decode()
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "what?"}]
    frames, meta = decode_video(mp4, MediaLimits(video_fps=VIDEO_FPS), frame_multiple=2)
    indices = sample_frame_indices(meta["total_frames"], meta["sampled_frames"])
    hf_meta = VideoMetadata(total_num_frames=meta["total_frames"], fps=8.0, frames_indices=indices)
    videos = {"videos": [np.asarray(frames)], "video_metadata": [hf_meta], "do_sample_frames": False}
    for f in [f for f in app["families"] if f.video]:
        served, _, _ = _chat(app["client"], f, [{"role": "user", "content": content}])
        assert served == _hf(app, f, [{"type": "video"}, {"type": "text", "text": "what?"}], **videos), f.tiny


def test_three_turn_chat_hits_the_prefill_replicas_cache(app: dict[str, Any]) -> None:
    """Each turn re-sends the conversation with its image (Qwen2-Audio: its clip); its later turns
    find the previous turn's prompt (its full blocks; Qwen3.5: and the state snapshot at its end) in
    the prefill replica's prefix cache: usage's ``cached_tokens`` is that prefill-side hit (the prompt
    is computed there; the decode side's hit shows as blocks it did not pull, ``kv_blocks_hit``).
    Where the released template writes a past answer without its generation prompt's opener (Qwen3.5's
    ``<think>``): the previous prompt less those tokens; a hybrid's snapshot then sits past where the
    prompts part, so it has no bound."""
    for f in app["families"]:
        decode_hits = _stats("decode", f)["kv_blocks_hit"]
        part, hf_part, media = _item(f, 70)
        served: list[dict[str, Any]] = []
        hf_msgs: list[dict[str, Any]] = []
        prev_prompt, prev_msgs = 0, []  # the previous turn's prompt tokens (served) and messages (HF's)
        for turn, question in enumerate(["What is this?", "And its colours?", "Anything else?"]):
            text = {"type": "text", "text": question}
            served.append({"role": "user", "content": [part, text] if turn == 0 else question})
            hf_msgs.append({"role": "user", "content": [hf_part, text] if turn == 0 else question})
            answer, prompt, cached = _chat(app["client"], f, served)
            expected = hf_generate(app["cache_dir"] / f.model, hf_msgs, MAX_TOKENS, **media)
            assert answer == expected, (f.tiny, turn)
            if turn:
                assert cached > 0, (f.tiny, turn, prev_prompt)
                drop = hf_unshared_tail(app["cache_dir"] / f.model, prev_msgs, hf_msgs)
                if f.full_hit and not (drop and f.tiny == "qwen3.5"):
                    assert cached >= (prev_prompt - drop) // BLOCK * BLOCK, (f.tiny, turn, cached, drop)
            prev_prompt, prev_msgs = prompt, list(hf_msgs)
            served.append({"role": "assistant", "content": answer})
            hf_msgs.append({"role": "assistant", "content": answer})
        if f.decode_hit:
            assert _stats("decode", f)["kv_blocks_hit"] > decode_hits, f.tiny


def test_decode_side_preemption_equals_hf(app: dict[str, Any]) -> None:
    """Two text requests of about 0.3 of the KV pool each, generating another 0.3: both are imported,
    their decodes outgrow the decode replica's pool, one is preempted and recomputed there from its
    prefix cache (text: the decode side never fetches embeddings). The two must decode at once: where
    one was imported after the other ended (a busy host), the pair is sent again, up to 3 times."""
    for f in app["families"]:
        n = f.max_model_len * 3 // 10  # new tokens; the prompts' words are 2-3 tokens each
        words = f.max_model_len // 12
        preempted = False
        for attempt in range(3):
            before = _stats("decode", f)["num_preemptions"]
            texts = [
                f"Story {i + 2 * attempt}: " + " ".join(f"w{(7 * i + k) % 50}" for k in range(words))
                for i in range(2)
            ]
            with ThreadPoolExecutor(2) as pool:
                asks = [
                    pool.submit(_chat, app["client"], f, [{"role": "user", "content": t}], n) for t in texts
                ]
                served = [a.result()[0] for a in asks]
            for text, got in zip(texts, served, strict=True):
                assert got == _hf(app, f, [{"type": "text", "text": text}], n), (f.tiny, text)
            if _stats("decode", f)["num_preemptions"] > before:
                preempted = True
                break
        assert preempted, f.tiny


def test_decode_side_preemption_of_media_requests_swaps_and_equals_hf(app: dict[str, Any]) -> None:
    """Two requests with an image (Qwen2-Audio: a clip) generating about 0.3 of the decode replica's
    KV pool each: their decodes outgrow it and one is preempted there. It holds no embeddings (the
    decode pool never fetches media), so it cannot recompute its prompt: its KV is swapped to host
    memory and back (``kv_swapped_out``), and both answers equal HF's. Afterwards the swap space holds
    nothing. As above, the pair is sent again (new media) where one was imported after the other ended."""
    for f in app["families"]:
        n = f.max_model_len * 3 // 10
        words = f.max_model_len // 24
        swapped = False
        for attempt in range(3):
            before = _stats("decode", f)
            # small media: both prompts fit the decode replica's pool at once (Qwen2-Audio's 1.2 s clip
            # takes 21 of its 40 blocks)
            items = [_item(f, 90 + 2 * attempt + i, size=(48, 32), seconds=0.5) for i in range(2)]
            texts = [
                f"Story {i + 2 * attempt}: " + " ".join(f"w{(5 * i + k) % 40}" for k in range(words))
                for i in range(2)
            ]
            with ThreadPoolExecutor(2) as pool:
                asks = [
                    pool.submit(
                        _chat,
                        app["client"],
                        f,
                        [{"role": "user", "content": [part, {"type": "text", "text": t}]}],
                        n,
                    )
                    for (part, _, _), t in zip(items, texts, strict=True)
                ]
                served = [a.result()[0] for a in asks]
            for (_, hf_part, media), text, got in zip(items, texts, served, strict=True):
                assert got == _hf(app, f, [hf_part, {"type": "text", "text": text}], n, **media), (
                    f.tiny,
                    text,
                )
            after = _stats("decode", f)
            if after["kv_swapped_out"] > before["kv_swapped_out"]:
                swapped = True
                break
        assert swapped, f.tiny
        after = _stats("decode", f)
        assert after["kv_swap_bytes"] == 0 and after["kv_swap_refused"] == 0, f.tiny
        assert after["num_running"] == after["num_waiting"] == 0, f.tiny


def test_a_request_only_the_prefill_pool_cannot_hold_is_its_400(app: dict[str, Any]) -> None:
    """A pool's own engine settings (``llm.pools[].engine``): the prefill pool has one KV block fewer
    than a whole ``max_model_len`` needs, the decode pool all of them. A request whose prompt and
    ``max_tokens`` fill ``max_model_len`` (no ``max_tokens``: the rest of it) is refused by the prefill
    replica's engine and reaches the client as that 400 ``too_many_blocks`` with its message, not as a
    hand-off failed and retried into a 503; nothing is left held on either side."""
    import openai

    for f in [f for f in app["families"] if f.prefill_engine]:
        blocks = dict(f.prefill_engine)["num_kv_blocks"]
        before = _stats("decode", f)
        with pytest.raises(openai.BadRequestError) as err:
            app["client"].chat.completions.create(
                model=f.model, messages=[{"role": "user", "content": "hello"}], temperature=0
            )
        assert err.value.status_code == 400, f.tiny
        assert err.value.code == "too_many_blocks", err.value.body
        assert err.value.message.endswith(
            f"need {blocks + 1} KV blocks of {BLOCK} tokens; the pool has {blocks}"
        )
        after = _stats("decode", f)
        assert after["kv_imports"] == before["kv_imports"] and after["kv_failed_imports"] == 0, f.tiny
        p = _stats("prefill", f)
        assert p["num_running"] == p["num_waiting"] == 0 and p["kv_expired"] == 0, f.tiny
        # the same prompt with room for the prefill pool is served (the decode pool's 40 blocks hold it)
        served, _, _ = _chat(app["client"], f, [{"role": "user", "content": "hello"}])
        assert served == _hf(app, f, [{"type": "text", "text": "hello"}]), f.tiny


def test_every_pin_ended_by_its_pull(app: dict[str, Any]) -> None:
    for f in app["families"]:
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
