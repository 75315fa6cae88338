"""Gemma 3's SigLIP tower + pooling projector equals transformers' ``get_image_features`` in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from encoder_service.encode.runner import EncoderRunner
from encoder_service.types import EncoderInput
from tests.media import make_image_array
from tests.tiny_dirs import tiny_model_dir
from tests.unit.encoder_service.encode.models.inputs import processor

ATOL, RTOL = 1e-5, 1e-5


def gemma3_image(model_dir: Path, width: int, height: int, seed: int) -> EncoderInput:
    out = processor(model_dir).image_processor(
        images=[make_image_array(width, height, seed)], return_tensors="pt"
    )
    return EncoderInput(
        f"img-{width}x{height}-{seed}", "image", 16, None, {"pixel_values": out["pixel_values"]}
    )


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("gemma3")


def test_tower_equals_hf_on_a_mixed_batch(model_dir: Path) -> None:
    from transformers import Gemma3ForConditionalGeneration

    hf = Gemma3ForConditionalGeneration.from_pretrained(model_dir).eval()
    items = [gemma3_image(model_dir, w, h, s) for w, h, s in [(300, 200, 1), (40, 90, 2), (64, 64, 3)]]
    runner = EncoderRunner(model_dir, device="cpu")
    batched = runner.encode(items)
    alone = [runner.encode([it])[0] for it in items]
    with torch.no_grad():
        ref = hf.model.get_image_features(
            pixel_values=torch.cat([it.tensors["pixel_values"] for it in items])
        ).pooler_output
    assert runner.family == "gemma3" and [t.shape for t in batched] == [(16, 64)] * 3
    for ours, one, expected in zip(batched, alone, ref, strict=True):
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(one, expected, atol=ATOL, rtol=RTOL)
    assert (ref[0] - ref[1]).abs().max() > 1e-2  # the images differ, so the comparison can fail


def test_bad_pixels_are_refused_by_name(model_dir: Path) -> None:
    runner = EncoderRunner(model_dir, device="cpu")
    bad = EncoderInput("bad", "image", 16, None, {"pixel_values": torch.zeros(1, 3, 32, 32)})
    with pytest.raises(ValueError, match="bad: pixel tensor"):
        runner.encode([bad])
    wrong = EncoderInput("wrong", "image", 15, None, {"pixel_values": torch.zeros(1, 3, 64, 64)})
    with pytest.raises(ValueError, match="record says 15 embeddings"):
        runner.encode([wrong])
