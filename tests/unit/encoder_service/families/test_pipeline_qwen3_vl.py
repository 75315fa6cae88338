"""Qwen3-VL through mmserve's own pieces, no Ray: preprocessor (our image transform at patch 16,
mean/std 0.5) -> encoder runner (our tower: main + DeepStack rows) -> LLMEngine (our Qwen3 decoder,
DeepStack added in its first layers), against transformers' processor + generate. Greedy tokens agree."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from encoder_service.encode.runner import EncoderRunner
from encoder_service.preprocess.processing import Preprocessor
from encoder_service.types import MediaRef
from llm_service.config import EngineConfig
from llm_service.engine import LLMEngine
from llm_service.multimodal import MultiModalInput
from llm_service.outputs import GenerateRequest
from llm_service.sampling_params import SamplingParams
from tests.media import make_image_bytes
from tests.tiny_dirs import tiny_model_dir

N = 10


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("qwen3-vl")


def test_preprocess_encode_generate_equals_hf(model_dir: Path) -> None:
    from transformers import Qwen3VLForConditionalGeneration

    torch.set_num_threads(1)
    images = [make_image_bytes(300, 200, seed=3), make_image_bytes(96, 160, seed=4)]
    content = [
        {"type": "image", "media": MediaRef("image", data=images[0])},
        {"type": "text", "text": "and then"},
        {"type": "image", "media": MediaRef("image", data=images[1])},
        {"type": "text", "text": "what changed?"},
    ]
    pre = Preprocessor(model_dir, limit_mm_per_prompt={"image": 2})
    out = pre.preprocess_sync([{"role": "user", "content": content}])
    runner = EncoderRunner(model_dir, device="cpu")
    mm = []
    for item in out.items:
        assert item.data is not None
        (rows,) = runner.encode([item.data])
        assert rows.shape == (item.length, 64 * 3)  # main + 2 DeepStack levels
        mm.append(
            MultiModalInput.of(rows, item.placeholder.offset, item.mm_hash, item.modality, item.grid_thw)
        )
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=256))
    (ours,) = engine.generate([GenerateRequest(out.prompt_token_ids, SamplingParams(max_tokens=N), mm)])

    hf = Qwen3VLForConditionalGeneration.from_pretrained(model_dir).eval()
    proc = pre.family.hf
    hf_content = [{"type": "image"}, {"type": "text", "text": "and then"}, {"type": "image"}]
    hf_content.append({"type": "text", "text": "what changed?"})
    text = proc.apply_chat_template([{"role": "user", "content": hf_content}], add_generation_prompt=True)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = proc(text=[text], images=pil, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == out.prompt_token_ids
    for item, grid in zip(out.items, inputs["image_grid_thw"].tolist(), strict=True):
        assert item.grid_thw == tuple(grid)
    ours_pixels = torch.cat([it.data.tensors["pixel_values"] for it in out.items if it.data])
    torch.testing.assert_close(ours_pixels, inputs["pixel_values"], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        ref = hf.generate(**inputs, max_new_tokens=N, do_sample=False)[0, len(out.prompt_token_ids) :]
    assert ours.token_ids == ref.tolist()


def test_video_runs_through_the_pipeline_equal_hf(model_dir: Path) -> None:
    """A video at 1 fps: the preprocessor writes HF's timestamped runs (one per temporal patch), the
    tower encodes the clip once, each run takes its rows; greedy tokens equal HF's."""
    import numpy as np
    from transformers import Qwen3VLForConditionalGeneration
    from transformers.video_utils import VideoMetadata

    from encoder_service.preprocess.media import MediaLimits
    from encoder_service.preprocess.media.video import decode_video, sample_frame_indices
    from tests.media import make_video_bytes

    torch.set_num_threads(1)
    limits = MediaLimits(video_fps=1.0)
    video = make_video_bytes(84, 56, num_frames=40, fps=8, seed=4)  # 5 s: 5 frames kept -> 6, 3 runs
    content = [
        {"type": "video", "media": MediaRef("video", data=video)},
        {"type": "text", "text": "what happens?"},
    ]
    pre = Preprocessor(model_dir, limits, {"video": 1})
    out = pre.preprocess_sync([{"role": "user", "content": content}])
    assert [(it.grid_thw, it.rows) for it in out.items] == [((1, 4, 6), (6 * i, 6 * i + 6)) for i in range(3)]
    first = out.items[0].data
    assert first is not None and all(it.data is None for it in out.items[1:])
    (rows,) = EncoderRunner(model_dir, device="cpu").encode([first])
    mm = [
        MultiModalInput.of(
            rows[it.rows[0] : it.rows[1]], it.placeholder.offset, it.mm_hash, "video", it.grid_thw
        )
        for it in out.items
        if it.rows is not None
    ]
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=256))
    (ours,) = engine.generate([GenerateRequest(out.prompt_token_ids, SamplingParams(max_tokens=N), mm)])

    frames, meta = decode_video(video, limits, frame_multiple=2)
    indices = sample_frame_indices(meta["total_frames"], meta["sampled_frames"])
    hf_meta = VideoMetadata(total_num_frames=meta["total_frames"], fps=8.0, frames_indices=indices)
    proc = pre.family.hf
    hf_content = [{"type": "video"}, {"type": "text", "text": "what happens?"}]
    text = proc.apply_chat_template([{"role": "user", "content": hf_content}], add_generation_prompt=True)
    inputs = proc(
        text=[text],
        videos=[np.asarray(frames)],
        video_metadata=[hf_meta],
        do_sample_frames=False,
        return_tensors="pt",
    )
    assert inputs["input_ids"][0].tolist() == out.prompt_token_ids
    hf = Qwen3VLForConditionalGeneration.from_pretrained(model_dir).eval()
    with torch.no_grad():
        ref = hf.generate(**inputs, max_new_tokens=N, do_sample=False)[0, len(out.prompt_token_ids) :]
    assert ours.token_ids == ref.tolist()


def test_video_cache_hit_builds_the_same_prompt(model_dir: Path) -> None:
    """A hit is never decoded: the entry's grid and frame times alone rebuild the timestamped runs."""
    import pickle

    from encoder_service.preprocess.media import MediaLimits
    from encoder_service.types import EmbeddingMeta
    from tests.media import make_video_bytes

    limits = MediaLimits(video_fps=1.0)
    video = make_video_bytes(84, 56, num_frames=40, fps=8, seed=5)
    msgs = [{"role": "user", "content": [{"type": "video", "media": MediaRef("video", data=video)}]}]
    miss = Preprocessor(model_dir, limits, {"video": 1}).preprocess_sync(msgs)
    enc = miss.items[0].data
    assert enc is not None and enc.frame_times is not None and len(enc.frame_times) == 3
    meta = EmbeddingMeta(
        enc.mm_hash, "video", enc.num_embeds, 192, "float32", enc.grid_thw, None, enc.frame_times
    )
    meta = pickle.loads(pickle.dumps(meta))  # as the cache index returns it
    fresh = Preprocessor(model_dir, limits, {"video": 1})
    hit = fresh.preprocess_sync(msgs, lambda hashes: {h: meta for h in hashes})
    assert fresh.num_processor_calls == 0
    assert hit.prompt_token_ids == miss.prompt_token_ids
    assert [(i.placeholder, i.rows, i.grid_thw) for i in hit.items] == [
        (i.placeholder, i.rows, i.grid_thw) for i in miss.items
    ]
