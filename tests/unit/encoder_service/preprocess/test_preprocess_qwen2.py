"""Preprocessor vs. the HF processor itself: same prompt ids, same per-item tensors; cache hits skip it."""

from __future__ import annotations

import asyncio
import base64
import io
import re
from typing import Any

import pytest
import torch
from PIL import Image

from encoder_service.preprocess.errors import MediaError, MMCacheMiss, TooManyItems
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.media.video import decode_video
from encoder_service.preprocess.processing import Preprocessor
from encoder_service.types import EmbeddingMeta, MediaRef
from tests.media import make_audio_bytes, make_image_bytes, make_video_bytes

LIMITS = MediaLimits(video_fps=4.0)


@pytest.fixture(scope="module")
def vl(tiny_vl_dir):
    return Preprocessor(tiny_vl_dir, LIMITS, {"image": 4, "video": 1}, 64 * 1024 * 1024)


@pytest.fixture(scope="module")
def audio(tiny_audio_dir):
    return Preprocessor(tiny_audio_dir, LIMITS, {"audio": 2}, 64 * 1024 * 1024)


def _img(w, h, seed=0):
    return MediaRef("image", data=make_image_bytes(w, h, seed=seed))


def _hf_vl(pre, messages, images=None, videos=None):
    hf = pre.family.hf
    tmpl = [
        {
            "role": m["role"],
            "content": m["content"]
            if isinstance(m["content"], str)
            else [{"type": p["type"]} if "media" in p else p for p in m["content"]],
        }
        for m in messages
    ]
    text = hf.apply_chat_template(tmpl, add_generation_prompt=True, tokenize=False)
    return hf(text=[text], images=images, videos=videos, return_tensors="pt")


@pytest.mark.parametrize(("w", "h"), [(64, 48), (200, 120), (33, 97)])
def test_image_matches_hf(vl, w, h):
    msgs = [
        {"role": "user", "content": [{"type": "image", "media": _img(w, h)}, {"type": "text", "text": "hi"}]}
    ]
    out = vl.preprocess_sync(msgs)
    ref = _hf_vl(vl, msgs, images=[Image.open(io.BytesIO(make_image_bytes(w, h))).convert("RGB")])
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()
    (item,) = out.items
    enc = item.data
    assert torch.equal(enc.tensors["pixel_values"], ref["pixel_values"])
    assert torch.equal(enc.tensors["image_grid_thw"], ref["image_grid_thw"])
    t, gh, gw = ref["image_grid_thw"][0].tolist()
    assert item.grid_thw == (t, gh, gw) and item.length == t * gh * gw // 4
    pad = vl.placeholder_token_ids["image"]
    ids = out.prompt_token_ids
    assert all(i == pad for i in ids[item.placeholder.offset : item.placeholder.end])
    assert ids[item.placeholder.offset - 1] != pad and ids[item.placeholder.end] != pad


def test_mixed_images_and_video_match_hf(vl):
    vid_bytes = make_video_bytes(64, 48, num_frames=8, fps=4)
    msgs = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "image", "media": _img(64, 48, seed=1)},
                {"type": "text", "text": "and"},
                {"type": "video", "media": MediaRef("video", data=vid_bytes)},
                {"type": "image", "media": _img(90, 60, seed=2)},
            ],
        },
    ]
    out = vl.preprocess_sync(msgs)
    frames, meta = decode_video(vid_bytes, LIMITS, frame_multiple=2)
    assert meta["sampled_frames"] == 8 and frames.shape == (8, 48, 64, 3)
    imgs = [
        Image.open(io.BytesIO(make_image_bytes(w, h, seed=s))).convert("RGB")
        for w, h, s in [(64, 48, 1), (90, 60, 2)]
    ]
    ref = _hf_vl(vl, msgs, images=imgs, videos=[frames])
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()
    img0, vid, img1 = out.items
    assert [it.modality for it in out.items] == ["image", "video", "image"]
    assert img0.placeholder.end < vid.placeholder.offset < img1.placeholder.offset
    n0 = img0.data.tensors["pixel_values"].shape[0]
    assert torch.equal(
        torch.cat([img0.data.tensors["pixel_values"], img1.data.tensors["pixel_values"]]),
        ref["pixel_values"],
    )
    assert n0 == int(ref["image_grid_thw"][0].prod())
    assert torch.equal(vid.data.tensors["pixel_values_videos"], ref["pixel_values_videos"])
    assert vid.grid_thw == tuple(ref["video_grid_thw"][0].tolist()) and vid.grid_thw[0] == 4


def test_audio_matches_hf(audio):
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "audio", "media": MediaRef("audio", data=make_audio_bytes(1.3))},
                {"type": "text", "text": "what"},
                {
                    "type": "audio",
                    "media": MediaRef("audio", data=make_audio_bytes(2.0, sr=8000, fmt="FLAC", seed=1)),
                },
            ],
        }
    ]
    out = audio.preprocess_sync(msgs)
    import librosa
    import soundfile as sf

    a1, _ = sf.read(io.BytesIO(make_audio_bytes(1.3)), dtype="float32")
    a2, sr2 = sf.read(io.BytesIO(make_audio_bytes(2.0, sr=8000, fmt="FLAC", seed=1)), dtype="float32")
    a2 = librosa.resample(a2, orig_sr=sr2, target_sr=16000)
    hf = audio.family.hf
    tmpl = [
        {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "what"}, {"type": "audio"}]}
    ]
    text = hf.apply_chat_template(tmpl, add_generation_prompt=True, tokenize=False)
    ref = hf(text=[text], audio=[a1, a2], sampling_rate=16000, return_tensors="pt")
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()
    for k, it in enumerate(out.items):
        assert torch.allclose(it.data.tensors["input_features"][0], ref["input_features"][k])
        assert torch.equal(it.data.tensors["feature_attention_mask"][0], ref["feature_attention_mask"][k])
    assert out.items[0].length == 32  # 130 frames → conv (stride 2) 65 → avg-pool (2, 2) 32
    assert not audio.uses_mrope and audio.sampling_rate == 16000


def test_cache_hit_skips_processor_and_keeps_ids(vl):
    msgs = [
        {
            "role": "user",
            "content": [{"type": "image", "media": _img(120, 80, seed=7)}, {"type": "text", "text": "x"}],
        }
    ]
    first = vl.preprocess_sync(msgs)
    it = first.items[0]
    meta = EmbeddingMeta(it.mm_hash, "image", it.length, 64, "float32", it.grid_thw)
    calls, pcache = vl.num_processor_calls, vl.processor_cache.stats()
    seen: list[list[str]] = []

    async def lookup(hashes):
        seen.append(hashes)
        return {it.mm_hash: meta}

    again = vl.preprocess_sync(msgs, lookup)
    assert seen == [[it.mm_hash]]
    assert again.prompt_token_ids == first.prompt_token_ids
    assert again.items[0].data is None and again.items[0].grid_thw == it.grid_thw
    assert vl.num_processor_calls == calls and vl.processor_cache.stats()["hits"] == pcache["hits"]
    # uuid only: an unknown name is a miss naming the item; once sent with the bytes, the name
    # resolves to their mm_hash and is served from the cache; an evicted entry is a miss again
    msgs_uuid = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "x"},
                {"type": "image", "media": MediaRef("image", uuid="cat-1")},
            ],
        }
    ]
    with pytest.raises(MMCacheMiss) as e:
        vl.preprocess_sync(msgs_uuid, lambda hs: {it.mm_hash: meta})
    assert e.value.status_code == 400 and e.value.item == 0 and "image 0" in str(e.value)
    named = [
        {
            "role": "user",
            "content": [
                {
                    "type": "image",
                    "media": MediaRef("image", data=msgs[0]["content"][0]["media"].data, uuid="cat-1"),
                }
            ],
        }
    ]
    assert vl.preprocess_sync(named, lambda hs: {it.mm_hash: meta}).items[0].mm_hash == it.mm_hash
    served = vl.preprocess_sync(msgs_uuid, lambda hs: {it.mm_hash: meta})
    assert served.items[0].mm_hash == it.mm_hash and served.items[0].length == it.length
    with pytest.raises(MMCacheMiss):
        vl.preprocess_sync(msgs_uuid, lambda hs: {})


def test_an_inline_cache_hit_is_prepared_without_a_turn_of_the_loop(vl):
    """Bytes inline (raw and as a data URL) and a cache that answers at once: ``preprocess`` runs
    to its end on the first step of the coroutine. Every yield there is a turn of a busy ingress
    loop added to the request's TTFT; a task per item made two."""
    data = make_image_bytes(64, 48, seed=11)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image", "media": MediaRef("image", data=data)},
                {"type": "image", "media": MediaRef("image", url=url)},
                {"type": "text", "text": "x"},
            ],
        }
    ]
    first = vl.preprocess_sync(msgs)
    metas = {
        it.mm_hash: EmbeddingMeta(it.mm_hash, "image", it.length, 64, "float32", it.grid_thw)
        for it in first.items
    }

    async def first_step() -> Any:
        coro = vl.preprocess(msgs, lambda hashes: metas, process=False)
        try:
            coro.send(None)
        except StopIteration as done:
            return done.value
        coro.close()
        raise AssertionError("preprocess yielded to the loop")

    again = asyncio.run(first_step())
    assert again.prompt_token_ids == first.prompt_token_ids
    assert [it.mm_hash for it in again.items] == [it.mm_hash for it in first.items]


def test_processor_cache_skips_repeat_work(vl):
    msgs = [{"role": "user", "content": [{"type": "image", "media": _img(70, 70, seed=9)}]}]
    a = vl.preprocess_sync(msgs)
    calls = vl.num_processor_calls
    b = vl.preprocess_sync(msgs)
    assert vl.num_processor_calls == calls
    assert torch.equal(a.items[0].data.tensors["pixel_values"], b.items[0].data.tensors["pixel_values"])


def test_limit_mm_per_prompt(vl, audio):
    vid = MediaRef("video", data=b"x")
    msgs = [{"role": "user", "content": [{"type": "video", "media": vid}, {"type": "video", "media": vid}]}]
    with pytest.raises(TooManyItems) as e:
        vl.preprocess_sync(msgs)
    assert e.value.code == "too_many_items" and e.value.item == 1
    with pytest.raises(TooManyItems):
        audio.preprocess_sync([{"role": "user", "content": [{"type": "image", "media": _img(8, 8)}]}])


def test_family_facts(vl):
    tok = vl.family.tokenizer
    assert vl.placeholder_token_ids == {
        "image": tok.convert_tokens_to_ids("<|image_pad|>"),
        "video": tok.convert_tokens_to_ids("<|video_pad|>"),
    }
    assert vl.uses_mrope and vl.family.frame_multiple == 2


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        ("video", b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 4),
        ("video", make_video_bytes(64, 48, num_frames=4, fps=4)[:300]),
        ("audio", b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\xff" * 64),
        ("audio", make_audio_bytes(0.5)[:30]),
    ],
)
def test_undecodable_video_and_audio_are_4xx_naming_the_item(vl, audio, kind, body):
    pre = vl if kind == "video" else audio
    msgs = [{"role": "user", "content": [{"type": kind, "media": MediaRef(kind, data=body)}]}]
    with pytest.raises(MediaError) as e:
        pre.preprocess_sync(msgs)
    assert 400 <= e.value.status_code < 500 and e.value.item == 0 and f"{kind} 0" in e.value.message


@pytest.mark.parametrize("spelled", ["<|video_pad|>", "<|image_pad|>"])
def test_text_spelling_a_placeholder_token_is_a_400_naming_it(vl, spelled):
    """vLLM's random-mm benchmark once drew ``<|video_pad|>`` into an image request's random text.
    transformers' processor refuses such a prompt ("Found 1 <|video_pad|> tokens in the text but no
    videos were passed"), and so does the preprocessor: a 400 that says the text spells it."""
    msgs = [
        {
            "role": "user",
            "content": [{"type": "image", "media": _img(64, 48)}, {"type": "text", "text": f"hi {spelled}"}],
        }
    ]
    with pytest.raises(MediaError, match="the message text spells the model's") as err:
        vl.preprocess_sync(msgs)
    assert err.value.status_code == 400 and err.value.code == "invalid_media_input"
    with pytest.raises(ValueError, match=re.escape(spelled)):
        image = Image.open(io.BytesIO(make_image_bytes(64, 48))).convert("RGB")
        _hf_vl(vl, msgs, images=[image])
