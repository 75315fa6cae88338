"""Our towers against transformers' own on the tiny models, float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from encoder_service.encode.batching import EncoderBudgetError
from encoder_service.encode.models import load_encoder_model
from encoder_service.encode.runner import EncoderRunner
from encoder_service.encode.tp.parallel import TPContext
from encoder_service.types import EncoderInput
from tests.media import make_audio_array
from tests.unit.encoder_service.encode.models.inputs import audio_input, image_input, processor, video_input

ATOL, RTOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def hf_vl(tiny_vl_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(str(tiny_vl_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def vl_runner(tiny_vl_dir: Path) -> EncoderRunner:
    return EncoderRunner(tiny_vl_dir, device="cpu")


def hf_vision(model, item) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        if item.modality == "image":
            out = model.get_image_features(item.tensors["pixel_values"], item.tensors["image_grid_thw"])
        else:
            out = model.get_video_features(
                item.tensors["pixel_values_videos"], item.tensors["video_grid_thw"]
            )
    (emb,) = out.pooler_output
    return emb


@pytest.mark.parametrize("size", [(56, 56), (64, 48), (100, 130), (300, 200)])
def test_image_matches_hf(size: tuple[int, int], tiny_vl_dir: Path, hf_vl, vl_runner: EncoderRunner) -> None:  # type: ignore[no-untyped-def]
    item = image_input(tiny_vl_dir, *size)
    (ours,) = vl_runner.encode([item])
    ref = hf_vision(hf_vl, item)
    assert ours.shape == (item.num_embeds, 64) == ref.shape
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)


def test_mixed_batch_matches_hf_item_by_item(tiny_vl_dir: Path, hf_vl, vl_runner: EncoderRunner) -> None:  # type: ignore[no-untyped-def]
    items = [
        image_input(tiny_vl_dir, 64, 48, seed=1),
        video_input(tiny_vl_dir, 84, 56, frames=6, seed=2),
        image_input(tiny_vl_dir, 140, 90, seed=3),
    ]
    assert items[1].grid_thw is not None and items[1].grid_thw[0] == 3  # 6 frames -> 3 temporal patches
    outs = vl_runner.encode(items)
    assert [o.shape[0] for o in outs] == [it.num_embeds for it in items]
    for item, ours in zip(items, outs, strict=True):
        # HF encodes each item alone: equality proves items in one batch do not attend to each other.
        torch.testing.assert_close(ours, hf_vision(hf_vl, item), atol=ATOL, rtol=RTOL)
    assert not torch.allclose(outs[0], outs[2][: outs[0].shape[0]])


def test_budget_splits_steps_and_refuses_oversize(tiny_vl_dir: Path, vl_runner: EncoderRunner) -> None:
    items = [image_input(tiny_vl_dir, 100, 130, seed=s) for s in range(3)]  # 20 embeddings each
    small = EncoderRunner(tiny_vl_dir, device="cpu", max_num_encoder_input_tokens=45)
    for a, b in zip(small.encode(items), vl_runner.encode(items), strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
    with pytest.raises(EncoderBudgetError):
        EncoderRunner(tiny_vl_dir, device="cpu", max_num_encoder_input_tokens=19).encode(items)


def test_bad_records_are_refused(tiny_vl_dir: Path, vl_runner: EncoderRunner) -> None:
    item = image_input(tiny_vl_dir, 64, 48)
    item.num_embeds += 1
    with pytest.raises(ValueError, match="record says 5 embeddings"):
        vl_runner.encode([item])
    item.num_embeds -= 1
    item.tensors["pixel_values"] = item.tensors["pixel_values"][:-4]
    with pytest.raises(ValueError, match="does not match grid"):
        vl_runner.encode([item])
    with pytest.raises(ValueError, match="cannot encode 'audio'"):
        vl_runner.encode([EncoderInput("a", "audio", 25, None, {})])


def test_tp_size_must_divide_heads(tiny_vl_dir: Path) -> None:
    with pytest.raises(ValueError, match="vision num_heads=2 is not divisible by the encoder TP size 3"):
        load_encoder_model(tiny_vl_dir, torch.float32, torch.device("cpu"), TPContext(rank=0, size=3))


def test_audio_matches_hf_generation_path(tiny_audio_dir: Path) -> None:
    """Reference: the embeddings HF scatters into the LLM's inputs_embeds for a batch of three clips."""
    from transformers import Qwen2AudioForConditionalGeneration

    clips = [(1.0, 0), (2.5, 1), (30.0, 2)]
    items = [audio_input(tiny_audio_dir, s, seed) for s, seed in clips]
    runner = EncoderRunner(tiny_audio_dir, device="cpu")
    assert (runner.family, runner.hidden_size) == ("qwen2-audio", 64)
    outs = runner.encode(items)
    assert [o.shape[0] for o in outs] == [25, 62, 750]

    hf = Qwen2AudioForConditionalGeneration.from_pretrained(str(tiny_audio_dir), dtype=torch.float32).eval()
    proc = processor(tiny_audio_dir)
    enc = proc(
        text=[f"<|audio_bos|>{proc.audio_token}<|audio_eos|>hi" for _ in clips],
        audio=[make_audio_array(s, seed=seed) for s, seed in clips],
        sampling_rate=16000,
        return_tensors="pt",
        padding=True,
    )
    captured: dict = {}
    hook = hf.model.language_model.register_forward_pre_hook(
        lambda _m, _a, kw: captured.update(kw), with_kwargs=True
    )
    with torch.no_grad():
        hf(**enc)
    hook.remove()
    for i, ours in enumerate(outs):
        ref = captured["inputs_embeds"][i][enc["input_ids"][i] == hf.config.audio_token_id]
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)
