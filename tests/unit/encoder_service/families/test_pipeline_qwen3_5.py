"""Qwen3.5 through mmserve's own pieces, no Ray: preprocessor (Qwen3-VL's adapter) -> encoder runner
(our tower, no DeepStack) -> LLMEngine (our hybrid decoder on paged KV + the state cache), against
transformers' processor + generate. Greedy tokens agree, for two images and for a video (timestamped
runs, one per temporal patch, each taking its rows of the one encoder output)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from encoder_service.encode.runner import EncoderRunner
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.media.video import decode_video, sample_frame_indices
from encoder_service.preprocess.processing import Preprocessor
from encoder_service.types import MediaRef
from llm_service.config import EngineConfig
from llm_service.engine import LLMEngine
from llm_service.multimodal import MultiModalInput
from llm_service.outputs import GenerateRequest
from llm_service.sampling_params import SamplingParams
from tests.media import make_image_bytes, make_video_bytes
from tests.tiny_dirs import tiny_model_dir

N = 10


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("qwen3.5")


@pytest.fixture(scope="module")
def hf(model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import Qwen3_5ForConditionalGeneration

    torch.set_num_threads(1)
    return Qwen3_5ForConditionalGeneration.from_pretrained(model_dir).eval()


def _serve(model_dir: Path, prompt: list[int], mm: list[MultiModalInput]) -> list[int]:
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=256, max_num_batched_tokens=32)
    )
    (ours,) = engine.generate([GenerateRequest(prompt, SamplingParams(max_tokens=N), mm)])
    return ours.token_ids


def test_two_images_equal_hf(model_dir: Path, hf) -> None:  # type: ignore[no-untyped-def]
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
        assert rows.shape == (item.length, 64)
        mm.append(
            MultiModalInput.of(rows, item.placeholder.offset, item.mm_hash, item.modality, item.grid_thw)
        )
    ours = _serve(model_dir, out.prompt_token_ids, mm)

    proc = pre.family.hf
    hf_content = [{"type": "image"}, {"type": "text", "text": "and then"}, {"type": "image"}]
    hf_content.append({"type": "text", "text": "what changed?"})
    text = proc.apply_chat_template([{"role": "user", "content": hf_content}], add_generation_prompt=True)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = proc(text=[text], images=pil, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == out.prompt_token_ids
    with torch.no_grad():
        ref = hf.generate(**inputs, max_new_tokens=N, do_sample=False)[0, len(out.prompt_token_ids) :]
    assert ours == ref.tolist()


def test_video_equals_hf(model_dir: Path, hf) -> None:  # type: ignore[no-untyped-def]
    from transformers.video_utils import VideoMetadata

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
    assert first is not None
    (rows,) = EncoderRunner(model_dir, device="cpu").encode([first])
    mm = [
        MultiModalInput.of(
            rows[it.rows[0] : it.rows[1]], it.placeholder.offset, it.mm_hash, "video", it.grid_thw
        )
        for it in out.items
        if it.rows is not None
    ]
    ours = _serve(model_dir, out.prompt_token_ids, mm)

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
    with torch.no_grad():
        ref = hf.generate(**inputs, max_new_tokens=N, do_sample=False)[0, len(out.prompt_token_ids) :]
    assert ours == ref.tolist()
