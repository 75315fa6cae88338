"""Build EncoderInputs the way the preprocessor does: the HF processor, one item at a time."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from encoder_service.types import EncoderInput
from tests.media import make_audio_array, make_image_array


@cache
def processor(model_dir: Path) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(model_dir))


def _grid(t: torch.Tensor) -> tuple[int, int, int]:
    a, b, c = (int(v) for v in t.reshape(3).tolist())
    return a, b, c


def image_input(model_dir: Path, width: int, height: int, seed: int = 0) -> EncoderInput:
    out = processor(model_dir).image_processor(
        images=[make_image_array(width, height, seed)], return_tensors="pt"
    )
    grid = _grid(out["image_grid_thw"])
    tensors = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    return EncoderInput(
        f"img-{width}x{height}-{seed}", "image", grid[0] * grid[1] * grid[2] // 4, grid, tensors
    )


def video_input(model_dir: Path, width: int, height: int, frames: int, seed: int = 0) -> EncoderInput:
    base = make_image_array(width + 2 * frames, height, seed)
    video = np.stack([base[:, 2 * i : 2 * i + width] for i in range(frames)])  # [T, H, W, 3]
    out = processor(model_dir).video_processor(videos=[video], return_tensors="pt", do_sample_frames=False)
    grid = _grid(out["video_grid_thw"])
    tensors = {"pixel_values_videos": out["pixel_values_videos"], "video_grid_thw": out["video_grid_thw"]}
    return EncoderInput(
        f"vid-{width}x{height}x{frames}-{seed}", "video", grid[0] * grid[1] * grid[2] // 4, grid, tensors
    )


def audio_input(model_dir: Path, seconds: float, seed: int = 0) -> EncoderInput:
    fe = processor(model_dir).feature_extractor
    out = fe(
        make_audio_array(seconds, seed=seed),
        sampling_rate=16000,
        return_attention_mask=True,
        padding="max_length",
        return_tensors="pt",
    )
    mask = out["attention_mask"]
    frames = int(mask.sum())
    after_conv = (frames - 1) // 2 + 1
    n = (after_conv - 2) // 2 + 1
    tensors = {"input_features": out["input_features"], "feature_attention_mask": mask}
    return EncoderInput(f"aud-{seconds}-{seed}", "audio", n, None, tensors)
