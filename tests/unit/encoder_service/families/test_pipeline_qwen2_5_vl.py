"""Qwen2.5-VL through mmserve's own pieces, no Ray: preprocessor -> encoder runner (our tower) ->
LLMEngine (our decoder, absolute-time M-RoPE from the adapter's second_per_grid_ts), against
transformers' processor + generate on the same decoded media. Greedy tokens must agree."""

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
from encoder_service.preprocess.processors import Qwen25VLFamily
from encoder_service.types import MediaRef
from llm_service.config import EngineConfig
from llm_service.engine import LLMEngine
from llm_service.multimodal import MultiModalInput
from llm_service.outputs import GenerateRequest
from llm_service.sampling_params import SamplingParams
from tests.media import make_image_bytes, make_video_bytes
from tests.tiny_dirs import tiny_model_dir

N = 10
LIMITS = MediaLimits(video_fps=1.0)  # 3 s at 8 fps: 3 frames kept -> 4 (a multiple of 2): 4/3 fps


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("qwen2.5-vl")


def test_preprocess_encode_generate_equals_hf(model_dir: Path) -> None:
    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.video_utils import VideoMetadata

    torch.set_num_threads(1)
    image = make_image_bytes(300, 200, seed=3)
    video = make_video_bytes(84, 56, num_frames=24, fps=8, seed=4)
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image", "media": MediaRef("image", data=image)},
                {"type": "text", "text": "and then"},
                {"type": "video", "media": MediaRef("video", data=video)},
                {"type": "text", "text": "what changed?"},
            ],
        }
    ]
    pre = Preprocessor(model_dir, LIMITS, {"image": 1, "video": 1})
    out = pre.preprocess_sync(msgs)
    assert isinstance(pre.family, Qwen25VLFamily)
    runner = EncoderRunner(model_dir, device="cpu")
    mm = []
    for item in out.items:
        assert item.data is not None
        (emb,) = runner.encode([item.data])
        assert item.data.second_per_grid_ts == item.second_per_grid_ts  # what the cache keeps
        spgt = item.second_per_grid_ts  # the preprocessor's hand-off, as the app carries it
        mm.append(
            MultiModalInput.of(emb, item.placeholder.offset, item.mm_hash, item.modality, item.grid_thw, spgt)
        )
    assert mm[0].second_per_grid_ts is None
    assert mm[1].second_per_grid_ts == pytest.approx(2 * 3 / 4)  # 2 frames a temporal patch, 3 s, 4 frames
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=256))
    (ours,) = engine.generate([GenerateRequest(out.prompt_token_ids, SamplingParams(max_tokens=N), mm)])

    frames, meta = decode_video(video, LIMITS, frame_multiple=2)
    indices = sample_frame_indices(meta["total_frames"], meta["sampled_frames"])
    hf_meta = VideoMetadata(total_num_frames=meta["total_frames"], fps=8.0, frames_indices=indices)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir).eval()
    proc = pre.family.hf
    content = [{"type": "image"}, {"type": "text", "text": "and then"}, {"type": "video"}]
    content.append({"type": "text", "text": "what changed?"})
    text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    inputs = proc(
        text=[text],
        images=[Image.open(io.BytesIO(image)).convert("RGB")],
        videos=[np.asarray(frames)],
        video_metadata=[hf_meta],
        return_tensors="pt",
    )
    assert inputs["input_ids"][0].tolist() == out.prompt_token_ids
    assert float(inputs["second_per_grid_ts"][0]) == pytest.approx(mm[1].second_per_grid_ts, rel=1e-3)
    with torch.no_grad():
        ref = hf.generate(**inputs, max_new_tokens=N, do_sample=False)[0, len(out.prompt_token_ids) :]
    assert ours.token_ids == ref.tolist()
