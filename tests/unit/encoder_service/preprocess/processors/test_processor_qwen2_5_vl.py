"""The Qwen2.5-VL adapter vs. transformers' ``Qwen2_5_VLProcessor``: same prompt ids and per-item
tensors through the real preprocessor, and the same ``second_per_grid_ts`` for a decoded video."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.media.video import decode_video
from encoder_service.preprocess.processing import Preprocessor
from encoder_service.preprocess.processors import Qwen25VLFamily, load_family_processor
from encoder_service.types import MediaRef
from tests.media import make_image_bytes, make_video_bytes
from tests.tiny_dirs import tiny_model_dir

LIMITS = MediaLimits(video_fps=2.0)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("qwen2.5-vl")


@pytest.fixture(scope="module")
def pre(model_dir: Path) -> Preprocessor:
    return Preprocessor(model_dir, LIMITS, {"image": 2, "video": 1}, 64 * 1024 * 1024)


def hf_inputs(pre: Preprocessor, n_images: int, n_videos: int, **media):  # type: ignore[no-untyped-def]
    content = (
        [{"type": "image"}] * n_images + [{"type": "video"}] * n_videos + [{"type": "text", "text": "hi"}]
    )
    hf = pre.family.hf
    text = hf.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return hf(text=[text], return_tensors="pt", **media)


def test_family_adapter(pre: Preprocessor, model_dir: Path) -> None:
    fam = load_family_processor(model_dir, LIMITS)
    assert isinstance(fam, Qwen25VLFamily) and type(pre.family) is Qwen25VLFamily
    assert type(fam.hf).__name__ == "Qwen2_5_VLProcessor"
    assert fam.uses_mrope and fam.modalities == ("image", "video") and fam.frame_multiple == 2
    tok = fam.tokenizer
    assert fam.placeholder_token_ids == {
        "image": tok.convert_tokens_to_ids("<|image_pad|>"),
        "video": tok.convert_tokens_to_ids("<|video_pad|>"),
    }
    assert pre.hash_kwargs("video")["sample_fps"] == 2.0  # the sampling settings go into the video's mm_hash


def test_images_and_video_match_hf(pre: Preprocessor) -> None:
    images = [make_image_bytes(300, 200, seed=1), make_image_bytes(64, 48, seed=2)]
    video = make_video_bytes(84, 56, num_frames=8, fps=4)
    msgs = [
        {
            "role": "user",
            "content": [
                *({"type": "image", "media": MediaRef("image", data=b)} for b in images),
                {"type": "video", "media": MediaRef("video", data=video)},
                {"type": "text", "text": "hi"},
            ],
        }
    ]
    out = pre.preprocess_sync(msgs)
    frames, meta = decode_video(video, LIMITS, frame_multiple=2)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    ref = hf_inputs(pre, 2, 1, images=pil, videos=[frames])
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()
    img0, img1, vid = out.items
    for item, i in ((img0, 0), (img1, 1)):
        assert item.data is not None
        pv = item.data.tensors["pixel_values"]
        rows = [int(g.prod()) for g in ref["image_grid_thw"]]
        ref_pv = ref["pixel_values"].split(rows)[i]
        torch.testing.assert_close(pv, ref_pv, atol=1e-5, rtol=1e-5)
        assert item.grid_thw == tuple(ref["image_grid_thw"][i].tolist())
    assert vid.data is not None
    assert torch.equal(vid.data.tensors["pixel_values_videos"], ref["pixel_values_videos"])
    assert vid.grid_thw == tuple(ref["video_grid_thw"][0].tolist())
    assert meta["sampled_frames"] == 4  # 2 s of video at video_fps=2


@pytest.mark.parametrize(
    ("native_fps", "num_frames", "video_num_frames"), [(4, 8, None), (8, 24, None), (4, 12, 4)]
)
def test_second_per_grid_ts_matches_hf(
    pre: Preprocessor, native_fps: int, num_frames: int, video_num_frames: int | None
) -> None:
    """Our value from the decode's facts equals what HF derives from the same sampling's VideoMetadata."""
    from transformers.video_utils import VideoMetadata

    limits = MediaLimits(video_fps=2.0, video_num_frames=video_num_frames)
    data = make_video_bytes(56, 56, num_frames=num_frames, fps=native_fps)
    frames, meta = decode_video(data, limits, frame_multiple=2)
    family = Qwen25VLFamily(pre.family.hf, limits)
    ours = family.item_metadata("video", meta)["second_per_grid_ts"]
    indices = list(np.linspace(0, meta["total_frames"] - 1, meta["sampled_frames"]).round().astype(int))
    hf_meta = VideoMetadata(
        total_num_frames=meta["total_frames"], fps=float(native_fps), frames_indices=indices
    )
    ref = hf_inputs(pre, 0, 1, videos=[frames], video_metadata=[hf_meta])["second_per_grid_ts"]
    assert ours == pytest.approx(float(ref[0]), rel=1e-3)
    assert ours == pytest.approx(2 * meta["seconds"] / meta["sampled_frames"])
    assert family.item_metadata("image", meta) == {}


def test_second_per_grid_ts_without_decode_facts(pre: Preprocessor) -> None:
    assert Qwen25VLFamily(pre.family.hf, MediaLimits(video_fps=4.0)).second_per_grid_ts(None) == 0.5
    with pytest.raises(ValueError, match="video_num_frames is set"):
        Qwen25VLFamily(pre.family.hf, MediaLimits(video_num_frames=8)).second_per_grid_ts({})
