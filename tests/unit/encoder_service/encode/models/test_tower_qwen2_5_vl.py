"""Our Qwen2.5-VL vision tower against transformers' own on the tiny model, float32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from encoder_service.encode.models.qwen2_5_vl_vision import window_order
from encoder_service.encode.runner import EncoderRunner
from encoder_service.types import EncoderInput
from tests.tiny_dirs import tiny_model_dir
from tests.unit.encoder_service.encode.models.inputs import image_input, video_input

ATOL, RTOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("qwen2.5-vl")


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Any:
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def runner(model_dir: Path) -> EncoderRunner:
    return EncoderRunner(model_dir, device="cpu")


def hf_features(model: Any, items: list[EncoderInput]) -> list[torch.Tensor]:
    """HF's tower on the same items, one call per modality (HF packs a modality's items together)."""
    out: dict[str, list[torch.Tensor]] = {}
    with torch.no_grad():
        for modality, pix, grid, fn in (
            ("image", "pixel_values", "image_grid_thw", model.get_image_features),
            ("video", "pixel_values_videos", "video_grid_thw", model.get_video_features),
        ):
            mine = [it for it in items if it.modality == modality]
            if mine:
                res = fn(
                    torch.cat([it.tensors[pix] for it in mine]), torch.cat([it.tensors[grid] for it in mine])
                )
                out[modality] = list(res.pooler_output)
    return [out[it.modality].pop(0) for it in items]


def mixed_items(model_dir: Path) -> list[EncoderInput]:
    """Two images of different sizes (one spans several windows, with ragged edge windows) and a video."""
    return [
        image_input(model_dir, 300, 200, seed=1),  # grid 1x14x22 -> merged 7x11: 2x3 windows, edges 3 wide
        video_input(model_dir, 140, 84, frames=6, seed=2),  # grid 3x6x10 -> 3 frames of 3x5 merged
        image_input(model_dir, 64, 48, seed=3),  # a single window smaller than 4x4
    ]


def test_window_order_hand_computed() -> None:
    # One frame of merged 3x5 units, windows of 2x2 units: windows (0,1,5,6) (2,3,7,8) (4,9) (10,11) (12,13) (14)
    order, lengths = window_order([(1, 6, 10)], merge=2, window_units=2)
    assert order.tolist() == [0, 1, 5, 6, 2, 3, 7, 8, 4, 9, 10, 11, 12, 13, 14]
    assert lengths == [16, 16, 8, 8, 8, 4]
    # Two frames and a second item: frames stay contiguous, indices continue across items.
    order, lengths = window_order([(2, 4, 4), (1, 2, 2)], merge=2, window_units=4)
    assert order.tolist() == list(range(9)) and lengths == [16, 16, 4]


def test_family_and_sizes(runner: EncoderRunner) -> None:
    assert (runner.family, runner.hidden_size, runner.modalities) == ("qwen2.5-vl", 64, ("image", "video"))
    assert runner.model.fullatt_blocks == frozenset({1}) and runner.model.window_units == 4


def test_mixed_batch_matches_hf(model_dir: Path, hf: Any, runner: EncoderRunner) -> None:
    items = mixed_items(model_dir)
    assert [it.grid_thw for it in items] == [(1, 14, 22), (3, 6, 10), (1, 4, 4)]
    outs = runner.encode(items)
    refs = hf_features(hf, items)
    assert [o.shape for o in outs] == [r.shape for r in refs] == [(77, 64), (45, 64), (4, 64)]
    for ours, ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)


def test_items_alone_equal_items_batched(model_dir: Path, runner: EncoderRunner) -> None:
    items = mixed_items(model_dir)
    batched = runner.encode(items)
    for item, together in zip(items, batched, strict=True):
        (alone,) = runner.encode([item])
        torch.testing.assert_close(alone, together, atol=ATOL, rtol=RTOL)


def test_window_attention_matters(model_dir: Path, hf: Any, runner: EncoderRunner) -> None:
    """With every block attending over whole frames the large image's output changes: windows are real."""
    item = mixed_items(model_dir)[0]
    (windowed,) = runner.encode([item])
    model = runner.model
    saved = model.fullatt_blocks
    model.fullatt_blocks = frozenset(range(len(model.blocks)))
    try:
        (full,) = runner.encode([item])
    finally:
        model.fullatt_blocks = saved
    assert (windowed - full).abs().max() > 1e-3


def test_refuses_audio_and_bad_pixels(model_dir: Path, runner: EncoderRunner) -> None:
    with pytest.raises(ValueError, match=r"Qwen2\.5-VL's vision tower cannot encode 'audio'"):
        runner.encode([EncoderInput("a", "audio", 25, None, {})])
    item = image_input(model_dir, 64, 48)
    item.tensors["pixel_values"] = item.tensors["pixel_values"][:-4]
    with pytest.raises(ValueError, match="does not match grid"):
        runner.encode([item])
