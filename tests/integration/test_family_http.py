"""Families beyond the default pair, served over HTTP by ONE app (`tiny: <family>` in its config, the
openai client) and checked against transformers' ``generate`` on the same weights.

Every family runs with the same small engine (``ENGINE``): 16-token prefill chunks, so a prompt's
chunks cut through its images; 4-token KV blocks; a KV pool too small for the concurrent burst, so
some requests are preempted and recomputed. All but Gemma 3 hand their items to the LLM as they are
encoded (``overlap_prefill``), so their answers also show the prefill up to a missing item. A family is one line in ``FAMILIES``; every test runs
for each (parametrized), in one Ray start.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.hf_oracle import hf_generate
from tests.integration.local_app import local_app
from tests.media import (
    make_audio_bytes,
    make_image_array,
    make_image_bytes,
    make_video_bytes,
)


@dataclass(frozen=True)
class Family:
    tiny: str  # the config's `tiny` (the tiny generator's --family)
    video: bool  # the family takes video
    embeds_224: int = 64  # embeddings of a 224x224 image (Gemma 3: every image is its fixed 16)
    burst_images: int = 1  # images per request of the preempted burst (about 100 prompt tokens)
    # Gemma 3 computes an image (16 tokens) in one chunk: a 16-token budget would hold it only when no
    # other request decodes in that step, so concurrent requests would take turns instead of preempting.
    max_num_batched_tokens: int = 16
    audio: bool = False  # the family takes audio too
    # Gemma 4's images are many more tokens (a 96x64 one: 60): its three-turn chat needs more room,
    # with a KV pool of the same length (the burst still cannot run at once)
    max_model_len: int = 160
    llm_replicas: int = 1  # 2: its encoder outputs are shown shared across LLM replicas
    num_state_slots: int | None = None  # hybrids: sequences whose linear-attention states fit at once
    # items handed to the LLM as their encodes commit (preprocess.overlap_prefill): each answer below
    # then also shows the prefill up to a missing item and the resumption equal HF
    overlap: bool = True
    variant: str = "base"  # the tiny generator's --variant (Gemma 4: k_eq_v, moe)

    @property
    def model(self) -> str:
        return f"tiny-{self.tiny}" + ("" if self.variant == "base" else f"-{self.variant}")

    @property
    def label(self) -> str:
        return self.model.removeprefix("tiny-")


def gemma4(variant: str = "base", **kw: Any) -> Family:
    """Gemma 4: a 224x224 image is 96x96 pixels of 4x4 patches, pooled 3x3: 64 soft tokens, in one
    72-token chunk (its image spans attend both ways, so a chunk never cuts one)."""
    return Family("gemma4", video=False, embeds_224=64, audio=True, max_model_len=192, variant=variant, **kw)


FAMILIES = [
    Family("qwen2.5-vl", video=True),
    Family("qwen3-vl", video=True, embeds_224=49),  # patch 16: 224 px -> 14x14 patches -> 7x7
    Family("gemma3", video=False, embeds_224=16, burst_images=4, max_num_batched_tokens=24, overlap=False),
    gemma4(max_num_batched_tokens=72, llm_replicas=2),
    # its other recipes: full layers whose values are their keys (one KV head), and the MoE block
    # beside every MLP (one LLM replica each); image soft tokens attending causally (no
    # `use_bidirectional_attention`): 16-token chunks cut through its 64-token images
    gemma4("k_eq_v", max_num_batched_tokens=72),
    gemma4("moe", max_num_batched_tokens=72),
    gemma4("causal_vision"),
    # hybrid: linear-attention states in the state cache (two sequences' worth, so the burst also
    # waits for state slots); a prefix hit restores a state snapshot
    Family("qwen3.5", video=True, embeds_224=49, num_state_slots=2),
]
MAX_TOKENS = 8
VIDEO_FPS = 1.0  # not the default 2: positions depend on the per-video second_per_grid_ts
ENGINE = {
    "max_model_len": 160,
    "block_size": 4,
    "max_num_batched_tokens": 16,  # the least the config allows: prefill chunks cut through items
    "num_kv_blocks": 40,  # 160 tokens: one long request fits, the burst below does not
}


def _model_config(f: Family, cache_dir: Path) -> dict[str, Any]:
    if f.variant == "base":
        source: dict[str, str] = {"tiny": f.tiny}
    else:  # the config's `tiny` generates base recipes only: the variant is written here
        from cluster.tiny_model import make_tiny_model

        source = {"path": str(make_tiny_model(cache_dir / f.model, f.tiny, variant=f.variant))}
    return {
        "name": f.model,
        **source,
        "llm": {
            **ENGINE,
            "max_model_len": f.max_model_len,
            "num_kv_blocks": f.max_model_len // ENGINE["block_size"],
            "max_num_batched_tokens": f.max_num_batched_tokens,
            **({"deployment": {"num_replicas": f.llm_replicas}} if f.llm_replicas > 1 else {}),
            **({"num_state_slots": f.num_state_slots} if f.num_state_slots else {}),
        },
        "encoder": {"cache_index_shards": 1},  # one shard actor per model: a cheaper start
        "preprocess": {
            "limit_mm_per_prompt": {
                "image": 4,
                **({"video": 1} if f.video else {}),
                **({"audio": 2} if f.audio else {}),
            },
            "media": {"video_fps": VIDEO_FPS},
            "overlap_prefill": f.overlap,
        },
    }


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    cache_dir = tmp_path_factory.mktemp("models")
    models = [_model_config(f, Path(cache_dir)) for f in FAMILIES]
    # 9 models x (encoder, LLM, cache index) fractional replicas: more than 2 logical CPUs' worth
    with local_app({"models": models, "models_cache_dir": str(cache_dir)}, num_cpus=4) as client:
        yield {"client": client, "cache_dir": Path(cache_dir)}


def _ask(client: OpenAI, model: str, content: Any, max_tokens: int = MAX_TOKENS) -> tuple[str, int]:
    """The answer and its prompt tokens served from the prefix cache."""
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0
    )
    details = r.usage.prompt_tokens_details if r.usage else None
    return str(r.choices[0].message.content), int(getattr(details, "cached_tokens", 0) or 0)


def _image(w: int, h: int, seed: int) -> tuple[dict[str, Any], Any]:
    """An image content part (PNG data URL) and the same image for transformers."""
    from PIL import Image

    url = "data:image/png;base64," + base64.b64encode(make_image_bytes(w, h, seed=seed)).decode()
    return {"type": "image_url", "image_url": {"url": url}}, Image.fromarray(
        make_image_array(w, h, seed=seed)
    )


def _hf(
    f: Family, app: dict[str, Any], n_images: int, text: str, max_tokens: int = MAX_TOKENS, **media: Any
) -> str:
    content: list[dict[str, Any]] = [{"type": "image"} for _ in range(n_images)]
    if "videos" in media:
        content.append({"type": "video"})
    content.append({"type": "text", "text": text})
    model_dir = app["cache_dir"] / f.model
    return hf_generate(model_dir, [{"role": "user", "content": content}], max_tokens, **media)


_STATS_LOOP = asyncio.new_event_loop()  # handles run their router on the caller's loop (serve_env.py)


def _preemptions(f: Family) -> int:
    """Preemptions so far, over every LLM replica of the family."""
    return sum(int(s["num_preemptions"]) for s in _replica_stats(f).values())


def _replica_stats(f: Family) -> dict[str, dict[str, Any]]:
    """Each LLM replica's own counters, asked of it by name (the router honours ``target_replica``)."""
    import ray
    from ray import serve

    from llm_service.request_spec import ReplicaTarget

    prefix = f"SERVE_REPLICA::mmserve#LLMServer-{f.model}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    ids = [n.rsplit("#", 1)[-1] for n in names if n.startswith(prefix)]

    async def ask() -> dict[str, dict[str, Any]]:
        handle = serve.get_deployment_handle(f"LLMServer-{f.model}", app_name="mmserve")
        return {rid: dict(await asyncio.wait_for(handle.stats.remote(ReplicaTarget(rid)), 30)) for rid in ids}

    return _STATS_LOOP.run_until_complete(ask())


@pytest.mark.parametrize("f", FAMILIES, ids=lambda f: f.label)
def test_text_and_images_equal_hf(app: dict[str, Any], f: Family) -> None:
    client, model_dir = app["client"], app["cache_dir"] / f.model
    text = "hello there, tell me more"
    assert _ask(client, f.model, text)[0] == hf_generate(
        model_dir, [{"role": "user", "content": text}], MAX_TOKENS
    )
    parts, images = zip(*(_image(w, h, s) for w, h, s in [(96, 64, 31), (56, 120, 32)]), strict=True)
    for n in (1, 2):
        served, _ = _ask(client, f.model, [*parts[:n], {"type": "text", "text": "Compare."}])
        assert served == _hf(f, app, n, "Compare.", images=list(images[:n])), n


@pytest.mark.parametrize("f", FAMILIES, ids=lambda f: f.label)
def test_chunks_through_an_image_and_prefix_hit_equal_hf(app: dict[str, Any], f: Family) -> None:
    """A 224x224 image is 64 embeddings: 16-token chunks cut through it (Gemma 3: 16 embeddings, in
    one chunk: its scheduler never cuts an image). Asked again, the prompt's full blocks come from the
    prefix cache (and the embeddings from the encoder cache)."""
    part, image = _image(224, 224, 40)
    content = [part, {"type": "text", "text": "What is in it?"}]
    expected = _hf(f, app, 1, "What is in it?", images=[image])
    first, cached_first = _ask(client := app["client"], f.model, content)
    assert first == expected
    assert cached_first < 20  # at most the system prompt's blocks, cached by earlier requests
    again, cached_again = _ask(client, f.model, content)
    assert again == expected and cached_again >= cached_first + f.embeds_224


@pytest.mark.parametrize("f", [f for f in FAMILIES if f.video], ids=lambda f: f.label)
def test_video_at_non_default_fps_equals_hf(app: dict[str, Any], f: Family) -> None:
    import numpy as np
    from transformers.video_utils import VideoMetadata

    from encoder_service.preprocess.media import MediaLimits
    from encoder_service.preprocess.media.video import decode_video, sample_frame_indices

    mp4 = make_video_bytes(84, 56, num_frames=24, fps=8, seed=4)  # 3 s: 4 frames kept at 1 fps
    url = "data:video/mp4;base64," + base64.b64encode(mp4).decode()
    served, _ = _ask(
        app["client"],
        f.model,
        [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "what?"}],
    )
    frames, meta = decode_video(mp4, MediaLimits(video_fps=VIDEO_FPS), frame_multiple=2)
    indices = sample_frame_indices(meta["total_frames"], meta["sampled_frames"])
    hf_meta = VideoMetadata(total_num_frames=meta["total_frames"], fps=8.0, frames_indices=indices)
    videos = {"videos": [np.asarray(frames)], "video_metadata": [hf_meta], "do_sample_frames": False}
    assert served == _hf(f, app, 0, "what?", **videos)  # Qwen3-VL: timestamped runs, one per patch


@pytest.mark.parametrize("f", FAMILIES, ids=lambda f: f.label)
def test_preempted_burst_equals_hf(app: dict[str, Any], f: Family) -> None:
    """Four concurrent requests of about 100 prompt tokens + 40 generated on a 160-token KV pool: two
    cannot run at once, so requests are preempted (their KV freed) and recomputed; every answer still
    equals transformers'."""
    before = _preemptions(f)
    n = 40
    cases = [((224 - 28 * (i % 2), 224, 60 + i), f"Describe picture {i}.") for i in range(4)]
    k = f.burst_images
    asks = [[*[_image(*size)[0]] * k, {"type": "text", "text": text}] for size, text in cases]
    with ThreadPoolExecutor(len(asks)) as pool:
        served = list(pool.map(lambda c: _ask(app["client"], f.model, c, n)[0], asks))
    assert _preemptions(f) > before
    for (size, text), got in zip(cases, served, strict=True):
        assert got == _hf(f, app, k, text, n, images=[_image(*size)[1]] * k), size


@pytest.mark.parametrize("f", [f for f in FAMILIES if f.audio], ids=lambda f: f.label)
def test_audio_and_image_with_audio_equal_hf(app: dict[str, Any], f: Family) -> None:
    """A clip alone, then an image and a clip in one request (both through the encoder pool)."""
    import io

    import soundfile as sf

    wav = make_audio_bytes(1.2, freq=330.0, seed=5)
    clip = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    waveform = sf.read(io.BytesIO(wav), dtype="float32")[0]
    model_dir = app["cache_dir"] / f.model
    served, _ = _ask(app["client"], f.model, [clip, {"type": "text", "text": "What is it?"}])
    hf_content = [{"type": "audio"}, {"type": "text", "text": "What is it?"}]
    assert served == hf_generate(
        model_dir, [{"role": "user", "content": hf_content}], MAX_TOKENS, audio=[waveform]
    )
    part, image = _image(96, 64, 33)
    served, _ = _ask(app["client"], f.model, [part, clip, {"type": "text", "text": "Both?"}])
    hf_content = [{"type": "image"}, {"type": "audio"}, {"type": "text", "text": "Both?"}]
    expected = hf_generate(
        model_dir, [{"role": "user", "content": hf_content}], MAX_TOKENS, images=[image], audio=[waveform]
    )
    assert served == expected


@pytest.mark.parametrize("f", [f for f in FAMILIES if f.llm_replicas > 1], ids=lambda f: f.label)
def test_repeated_media_is_one_encoder_forward_across_llm_replicas(app: dict[str, Any], f: Family) -> None:
    """Ten conversations, each with the same image and the same clip: the encoder pool runs each item
    once, every other request takes its embeddings from the shared encoder cache, and every answer
    equals HF's. The last nine arrive together: the prefix router keeps them on the replica holding
    their common first block until it is 5 requests busier than the other (``balance_abs_threshold``
    4), so both replicas serve some."""
    import io

    import httpx
    import soundfile as sf

    wav = make_audio_bytes(0.8, freq=440.0, seed=7)
    clip = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    part, image = _image(80, 96, 34)
    texts = [f"Conversation {i}: " + " ".join(f"w{i * 7 + k}" for k in range(12)) for i in range(10)]
    stats_url = str(app["client"].base_url).replace("/v1/", "/stats")
    dispatched = lambda: httpx.get(stats_url).json()[f.model]["encoder_items_dispatched"]  # noqa: E731
    before, replicas_before = dispatched(), _replica_stats(f)
    assert len(replicas_before) == 2
    first, _ = _ask(app["client"], f.model, [{"type": "text", "text": texts[0]}, part, clip])
    assert dispatched() - before == 2  # the image and the clip, encoded once each
    with ThreadPoolExecutor(len(texts) - 1) as pool:
        rest = list(
            pool.map(
                lambda t: _ask(app["client"], f.model, [{"type": "text", "text": t}, part, clip])[0],
                texts[1:],
            )
        )
    assert dispatched() - before == 2  # nine more requests, no encoder forward
    after = _replica_stats(f)
    served = {
        rid: after[rid]["prefix_query_tokens"] - s["prefix_query_tokens"]
        for rid, s in replicas_before.items()
    }
    assert all(n > 0 for n in served.values()), served  # both replicas used the cached embeddings
    waveform = sf.read(io.BytesIO(wav), dtype="float32")[0]
    model_dir = app["cache_dir"] / f.model
    for text, got in zip(texts, [first, *rest], strict=True):
        hf_content = [{"type": "text", "text": text}, {"type": "image"}, {"type": "audio"}]
        messages = [{"role": "user", "content": hf_content}]
        assert got == hf_generate(model_dir, messages, MAX_TOKENS, images=[image], audio=[waveform]), text


@pytest.mark.parametrize("f", FAMILIES, ids=lambda f: f.label)
def test_bad_input_gets_the_coded_4xx(app: dict[str, Any], f: Family) -> None:
    """The same coded refusals as the default pair's (tests/integration/e2e/test_errors.py)."""
    import httpx

    png = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    garbage = {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,bm90IGEgdmlkZW8="}}
    cases: list[tuple[list[dict[str, Any]], int | None, str | None]] = [
        ([png] * 5, 400, "too_many_items"),  # limit_mm_per_prompt image: 4
        # undecodable audio where the family takes audio, else none allowed (limit_mm_per_prompt)
        ([audio], None, None) if f.audio else ([audio], 400, "too_many_items"),
        ([garbage], None, None),
        ([video], None, None) if f.video else ([video], 400, "too_many_items"),
    ]
    url = str(app["client"].base_url).rstrip("/") + "/chat/completions"
    for content, status, code in cases:
        body = {"model": f.model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
        r = httpx.post(url, json=body, timeout=60)
        assert 400 <= r.status_code < 500, r.text
        assert r.json()["error"]["message"], r.text
        if status is not None:
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
    r = httpx.post(
        url, json={"model": f.model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**5}
    )
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("f", FAMILIES, ids=lambda f: f.label)
def test_three_turn_chat_resending_its_image_hits_the_prefix_cache(app: dict[str, Any], f: Family) -> None:
    """Each turn re-sends the conversation with its image: every answer equals HF's, and each turn
    after the first finds at least the previous turn's prompt (its full blocks) in the prefix cache
    (a hybrid: KV blocks plus the state snapshot at the previous prompt's end). Where the released
    template writes a past answer without what its generation prompt opened (Qwen3.5's ``<think>``,
    Gemma 4's empty thought channel), the previous prompt less those tokens (counted by HF's
    tokenizer); a hybrid's snapshot then sits past where the prompts part, so it has no bound."""
    from tests.hf_oracle import hf_generate as hf_chat
    from tests.hf_oracle import hf_unshared_tail

    part, img = _image(96, 64, 70)
    served_msgs: list[dict[str, Any]] = []
    hf_msgs: list[dict[str, Any]] = []
    prev_prompt, prev_msgs = 0, []  # the previous turn's prompt tokens (served) and messages (HF's)
    for turn, question in enumerate(["What is this?", "And its colours?", "Anything else?"]):
        served_msgs.append(
            {"role": "user", "content": [part, {"type": "text", "text": question}] if turn == 0 else question}
        )
        hf_msgs.append(
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": question}] if turn == 0 else question,
            }
        )
        r = app["client"].chat.completions.create(
            model=f.model, messages=served_msgs, max_tokens=MAX_TOKENS, temperature=0
        )
        answer = str(r.choices[0].message.content)
        assert answer == hf_chat(app["cache_dir"] / f.model, hf_msgs, MAX_TOKENS, images=[img]), turn
        details = r.usage.prompt_tokens_details if r.usage else None
        cached = int(getattr(details, "cached_tokens", 0) or 0)
        drop = hf_unshared_tail(app["cache_dir"] / f.model, prev_msgs, hf_msgs) if turn else 0
        if turn and not (drop and f.num_state_slots):
            assert cached >= (prev_prompt - drop) // ENGINE["block_size"] * ENGINE["block_size"], (
                turn,
                cached,
                prev_prompt,
                drop,
            )
        prev_prompt, prev_msgs = (r.usage.prompt_tokens if r.usage else 0), list(hf_msgs)
        served_msgs.append({"role": "assistant", "content": answer})
        hf_msgs.append({"role": "assistant", "content": answer})
