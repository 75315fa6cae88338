"""Our Qwen3.5 vision tower (Qwen3-VL's without DeepStack) against transformers' own on the tiny
model, float32, on a mixed batch: two image sizes that interpolate the position table differently,
and a video."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from encoder_service.encode.runner import EncoderRunner
from encoder_service.families import encoder_family, row_units
from encoder_service.types import EncoderInput
from tests.tiny_dirs import tiny_model_dir
from tests.unit.encoder_service.encode.models.inputs import image_input, video_input

ATOL, RTOL = 1e-5, 1e-5
HIDDEN = 64


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("qwen3.5")


def hf_rows(model_dir: Path, items: list[EncoderInput]) -> list[torch.Tensor]:
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
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
                out[modality] = list(res.pooler_output)
    return [out[it.modality].pop(0) for it in items]


def test_family_facts(model_dir: Path) -> None:
    fam = encoder_family("qwen3_5")
    assert (fam.name, fam.modalities) == ("qwen3.5", ("image", "video"))
    assert row_units(model_dir, None) == row_units(None, "qwen3.5") == 1  # no DeepStack levels to carry


def test_mixed_batch_matches_hf(model_dir: Path) -> None:
    runner = EncoderRunner(model_dir, device="cpu")
    assert (runner.family, runner.hidden_size, runner.modalities) == ("qwen3.5", HIDDEN, ("image", "video"))
    items = [
        image_input(model_dir, 300, 200, seed=1),  # 12x18 patches from a 6x6 position table
        video_input(model_dir, 140, 84, frames=4, seed=2),
        image_input(model_dir, 64, 64, seed=3),  # 4x4 patches: the table is shrunk
    ]
    assert [it.grid_thw for it in items] == [(1, 12, 18), (2, 6, 8), (1, 4, 4)]
    outs = runner.encode(items)
    refs = hf_rows(model_dir, items)
    assert [tuple(o.shape) for o in outs] == [tuple(r.shape) for r in refs] == [(54, 64), (24, 64), (4, 64)]
    for ours, ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)
