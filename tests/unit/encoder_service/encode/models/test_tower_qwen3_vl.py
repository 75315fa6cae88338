"""Our Qwen3-VL vision tower against transformers' own on the tiny model, float32: the main
embeddings and every DeepStack level, on a mixed batch (two image sizes that interpolate the
position table differently, and a video)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from encoder_service.encode.models.qwen3_vl_vision import bilinear_taps
from encoder_service.encode.runner import EncoderRunner
from encoder_service.types import EncoderInput
from tests.tiny_dirs import tiny_model_dir
from tests.unit.encoder_service.encode.models.inputs import image_input, video_input

ATOL, RTOL = 1e-5, 1e-5
HIDDEN, LEVELS = 64, 2


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("qwen3-vl")


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Any:
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def runner(model_dir: Path) -> EncoderRunner:
    return EncoderRunner(model_dir, device="cpu")


def hf_rows(model: Any, items: list[EncoderInput]) -> list[torch.Tensor]:
    """HF's tower per modality: ``[main | deepstack 0 | deepstack 1]`` per item, as ours lays them out."""
    out: dict[str, list[torch.Tensor]] = {}
    with torch.no_grad():
        for modality, pix, grid, fn in (
            ("image", "pixel_values", "image_grid_thw", model.model.get_image_features),
            ("video", "pixel_values_videos", "video_grid_thw", model.model.get_video_features),
        ):
            mine = [it for it in items if it.modality == modality]
            if mine:
                res = fn(
                    torch.cat([it.tensors[pix] for it in mine]), torch.cat([it.tensors[grid] for it in mine])
                )
                levels = [list(level) for level in res.deepstack_features]
                out[modality] = [
                    torch.cat([main, *(level[i] for level in levels)], dim=-1)
                    for i, main in enumerate(res.pooler_output)
                ]
    return [out[it.modality].pop(0) for it in items]


def mixed_items(model_dir: Path) -> list[EncoderInput]:
    return [
        image_input(model_dir, 300, 200, seed=1),  # 12x18 patches from a 6x6 position table
        video_input(model_dir, 140, 84, frames=4, seed=2),
        image_input(model_dir, 64, 64, seed=3),  # 4x4 patches: the table is shrunk
    ]


def test_bilinear_taps_hand_computed() -> None:
    lo, hi, frac = bilinear_taps(4, 6)  # 0, 5/3, 10/3, 5 on a 6-long axis
    assert lo.tolist() == [0, 1, 3, 5] and hi.tolist() == [1, 2, 4, 5]
    torch.testing.assert_close(frac, torch.tensor([0.0, 2 / 3, 1 / 3, 0.0]))


def test_family_and_row_width(runner: EncoderRunner) -> None:
    assert (runner.family, runner.hidden_size) == ("qwen3-vl", HIDDEN * (1 + LEVELS))
    assert runner.modalities == ("image", "video")


def test_mixed_batch_matches_hf(model_dir: Path, hf: Any, runner: EncoderRunner) -> None:
    items = mixed_items(model_dir)
    assert [it.grid_thw for it in items] == [(1, 12, 18), (2, 6, 8), (1, 4, 4)]
    outs = runner.encode(items)
    refs = hf_rows(hf, items)
    assert (
        [tuple(o.shape) for o in outs] == [tuple(r.shape) for r in refs] == [(54, 192), (24, 192), (4, 192)]
    )
    for ours, ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)
    for level in range(1 + LEVELS):  # every level is its own signal, not a copy of the main embeddings
        cols = slice(level * HIDDEN, (level + 1) * HIDDEN)
        assert all(o[:, cols].abs().mean() > 0.05 for o in outs)
    assert (outs[0][:, :HIDDEN] - outs[0][:, HIDDEN : 2 * HIDDEN]).abs().max() > 0.1


def test_items_alone_equal_items_batched(model_dir: Path, runner: EncoderRunner) -> None:
    items = [it for it in mixed_items(model_dir) if it.modality == "image"]
    batched = runner.encode(items)
    for item, together in zip(items, batched, strict=True):
        (alone,) = runner.encode([item])
        torch.testing.assert_close(alone, together, atol=ATOL, rtol=RTOL)
