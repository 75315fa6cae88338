"""Gemma 4's vision tower + pooler + embedder equals transformers' ``get_image_features`` in float32,
on a batch of images of different aspect ratios (so different patch counts and soft tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from encoder_service.encode.runner import EncoderRunner
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.processors.gemma4 import Gemma4Family
from encoder_service.types import EncoderInput
from tests.media import make_image_array
from tests.tiny_dirs import tiny_model_dir
from tests.unit.encoder_service.encode.models.inputs import processor

ATOL, RTOL = 1e-5, 1e-5
SIZES = [(300, 200, 1), (40, 90, 2), (64, 64, 3), (200, 30, 4)]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("gemma4")


def gemma4_image(model_dir: Path, width: int, height: int, seed: int) -> EncoderInput:
    out = Gemma4Family(processor(model_dir), MediaLimits()).process(
        "image", make_image_array(width, height, seed)
    )
    return EncoderInput(f"img-{width}x{height}-{seed}", "image", out.num_embeds, None, out.tensors)


def test_tower_equals_hf_on_a_mixed_batch(model_dir: Path) -> None:
    from transformers import Gemma4ForConditionalGeneration

    hf = Gemma4ForConditionalGeneration.from_pretrained(model_dir).eval()
    items = [gemma4_image(model_dir, w, h, s) for w, h, s in SIZES]
    runner = EncoderRunner(model_dir, device="cpu")
    batched = runner.encode(items)
    alone = [runner.encode([it])[0] for it in items]
    hf_in = processor(model_dir).image_processor(
        images=[make_image_array(w, h, s) for w, h, s in SIZES], return_tensors="pt"
    )
    with torch.no_grad():
        ref = hf.model.get_image_features(hf_in["pixel_values"], hf_in["image_position_ids"]).pooler_output
    assert runner.family == "gemma4" and len({t.shape[0] for t in batched}) > 1  # item lengths differ
    assert [t.shape[0] for t in batched] == hf_in["num_soft_tokens_per_image"].tolist()
    for ours, one, expected in zip(batched, alone, ref, strict=True):
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(one, expected, atol=ATOL, rtol=RTOL)
    assert (ref[0][:5] - ref[2][:5]).abs().max() > 1e-2  # the images differ, so the comparison can fail


def test_bad_patches_are_refused_by_name(model_dir: Path) -> None:
    runner = EncoderRunner(model_dir, device="cpu")
    bad = EncoderInput(
        "bad",
        "image",
        1,
        None,
        {"pixel_values": torch.zeros(10, 48), "image_position_ids": torch.zeros(10, 2)},
    )
    with pytest.raises(ValueError, match="bad: pixel tensor"):
        runner.encode([bad])
    good = gemma4_image(model_dir, 64, 48, 1)
    wrong = EncoderInput("wrong", "image", good.num_embeds - 1, None, good.tensors)
    with pytest.raises(ValueError, match=f"record says {good.num_embeds - 1} embeddings"):
        runner.encode([wrong])


def test_conformer_equals_hf_and_mixes_with_images(model_dir: Path) -> None:
    """Clips whose last log-mel frames are padding (masked) and one that fills its frames; one batch
    holding an image and two clips gives each item what its tower alone gives."""
    from transformers import Gemma4ForConditionalGeneration

    from tests.media import make_audio_array

    hf = Gemma4ForConditionalGeneration.from_pretrained(model_dir).eval()
    fam = Gemma4Family(processor(model_dir), MediaLimits())
    runner = EncoderRunner(model_dir, device="cpu")
    clips = []
    for secs, freq in ((0.5, 300.0), (1.37, 500.0), (3.0, 200.0)):
        out = fam.process("audio", make_audio_array(secs, freq=freq))
        clips.append(EncoderInput(f"clip-{secs}", "audio", out.num_embeds, None, out.tensors))
    assert not bool(clips[0].tensors["input_features_mask"].all())  # the padding is masked
    for clip in clips:
        (ours,) = runner.encode([clip])
        with torch.no_grad():
            o = hf.model.get_audio_features(
                clip.tensors["input_features"], clip.tensors["input_features_mask"]
            )
        ref = o.pooler_output[o.attention_mask]
        assert ours.shape == ref.shape == (clip.num_embeds, 64)
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)
    image = gemma4_image(model_dir, 64, 48, 1)
    mixed = runner.encode([clips[0], image, clips[1]])
    alone = [runner.encode([x])[0] for x in (clips[0], image, clips[1])]
    for a, b in zip(mixed, alone, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
