"""mmserve's Qwen2-VL image path vs HF's own processors on the same decoded image.

Full-size decode: every float equals HF's torchvision-backend processor (the one ``AutoProcessor``
loads), for down- and up-scaled, unchanged, tiny and extreme-aspect sizes.
JPEG draft decode (libjpeg's DCT scaling when the processor shrinks the image ≥ 2× anyway): the grid is
HF's, and the pixels stay within JPEG-scale differences of HF's output on the full decode.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from cluster.bench.media import make_image_array
from encoder_service.preprocess.hashing import compute_mm_hash
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.media.image import decode_image_scaled
from encoder_service.preprocess.processing import Preprocessor
from encoder_service.preprocess.processors.qwen2_vl_image import Qwen2VLImageTransform
from encoder_service.types import MediaRef

LIMITS = MediaLimits()


@pytest.fixture(scope="module")
def vl(tiny_vl_dir):
    return Preprocessor(tiny_vl_dir, LIMITS, {"image": 2}, processor_cache_bytes=0)


@pytest.fixture(scope="module")
def hf_tv(tiny_vl_dir):
    return AutoImageProcessor.from_pretrained(str(tiny_vl_dir), backend="torchvision")


def _encode(w: int, h: int, fmt: str, seed: int = 0, mode: str = "RGB", quality: int = 90) -> bytes:
    img = Image.fromarray(make_image_array(w, h, seed)).convert(mode)
    buf = io.BytesIO()
    img.save(buf, fmt, **({"quality": quality} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _levels(pv: torch.Tensor, ref: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """|difference| in uint8 levels: the normalised values are (level - mean) / std per channel."""
    diff = (pv - ref).abs().view(pv.shape[0], 3, -1)
    return (diff * std.view(1, 3, 1)).flatten()


@pytest.mark.parametrize(
    ("w", "h", "fmt", "mode"),
    [
        (1280, 720, "JPEG", "RGB"),  # downscaled (over max_pixels)
        (224, 224, "PNG", "RGB"),  # already on the grid: no resize
        (33, 97, "PNG", "RGBA"),  # upscaled to min_pixels, alpha dropped by the decode
        (1, 1, "PNG", "L"),  # grayscale, smallest
        (5000, 25, "PNG", "RGB"),  # aspect ratio 200: the most Qwen2-VL takes
        (300, 200, "GIF", "P"),
        (130, 90, "WEBP", "RGB"),
        (90, 61, "BMP", "RGB"),
    ],
)
def test_full_decode_equals_hf_torchvision(vl, hf_tv, w, h, fmt, mode):
    data = _encode(w, h, fmt, mode=mode)
    decoded = decode_image_scaled(data, LIMITS)
    assert not decoded.reduced and decoded.image.mode == "RGB" and decoded.format == fmt
    ref = hf_tv(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")
    out = vl.family.process_image(decoded)
    assert torch.equal(out.tensors["image_grid_thw"], ref["image_grid_thw"])
    assert torch.equal(out.tensors["pixel_values"], ref["pixel_values"])
    t, gh, gw = ref["image_grid_thw"][0].tolist()
    assert out.grid_thw == (t, gh, gw) and out.num_embeds == t * gh * gw // 4


def test_preprocess_equals_hf_on_a_720p_jpeg(vl, hf_tv):
    """Through the whole pipeline (data URL in): no draft at 720p, so HF's exact floats."""
    data = _encode(1280, 720, "JPEG", seed=4)
    msgs = [{"role": "user", "content": [{"type": "image", "media": MediaRef("image", data=data)}]}]
    (item,) = vl.preprocess_sync(msgs).items
    ref = hf_tv(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")
    assert torch.equal(item.data.tensors["pixel_values"], ref["pixel_values"])
    assert item.metadata["width"] == 1280 and "decoded_size" not in item.metadata
    # mm_hash covers the ORIGINAL bytes (and the processor config with the decode policy)
    assert item.mm_hash == compute_mm_hash(
        vl.model_id, "image", data=data, processor_kwargs=vl.hash_kwargs("image")
    )


@pytest.mark.parametrize(("w", "h"), [(2600, 1500), (2400, 2400)])
def test_draft_decode_keeps_hf_grid_and_close_pixels(vl, hf_tv, w, h):
    """Draft tolerance, in uint8 levels of the resized image: mean ≤ 1.5, 99th percentile ≤ 6, max ≤ 16.

    libjpeg's 1/2-scale IDCT low-passes like a 2x2 box; HF's bicubic-AA from full size low-passes with
    a wider kernel; the two differ by about one level on average, a few at edges and noise, which is
    below the error JPEG's own quantisation already put there (measured: mean 0.8-1.0, p99 3-4, max
    7-10 levels at quality 75-90 on noisy photo-like images)."""
    data = _encode(w, h, "JPEG", seed=3, quality=80)
    min_size = vl.family.image_decode_size(w, h)
    decoded = decode_image_scaled(data, LIMITS, min_size=min_size)
    assert decoded.reduced and decoded.image.size == ((w + 1) // 2, (h + 1) // 2)
    assert (decoded.width, decoded.height) == (w, h)
    out = vl.family.process_image(decoded)
    ref = hf_tv(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")
    assert torch.equal(out.tensors["image_grid_thw"], ref["image_grid_thw"])
    assert out.tensors["pixel_values"].shape == ref["pixel_values"].shape
    levels = _levels(out.tensors["pixel_values"], ref["pixel_values"], torch.tensor(hf_tv.image_std) * 255)
    assert levels.mean() <= 1.5
    assert torch.quantile(levels[::11], 0.99) <= 6
    assert levels.max() <= 16


def test_mpo_is_a_jpeg_first_picture_and_drafts(vl):
    """Some cameras write MPO (a JPEG with more pictures after it): Pillow reports it as MPO."""
    first, second = (Image.fromarray(make_image_array(2600, 1500, s)) for s in (1, 2))
    buf = io.BytesIO()
    first.save(buf, "MPO", save_all=True, append_images=[second])
    decoded = decode_image_scaled(buf.getvalue(), LIMITS, min_size=(1176, 672))
    assert decoded.format == "MPO" and decoded.reduced and decoded.image.size == (1300, 750)
    full = decode_image_scaled(buf.getvalue(), LIMITS)
    assert np.array_equal(
        np.asarray(full.image), np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
    )


def test_draft_only_where_it_shrinks_and_only_for_jpeg(vl):
    assert vl.family.image_decode_size(1280, 720) == (1176, 672)  # HF smart_resize target
    png = decode_image_scaled(_encode(2600, 1500, "PNG"), LIMITS, min_size=(1176, 672))
    assert not png.reduced
    jpeg_720 = decode_image_scaled(_encode(1280, 720, "JPEG"), LIMITS, min_size=(1176, 672))
    assert not jpeg_720.reduced  # 1280/1176 < 2: a 1/2-scale decode would be under the target


def test_draft_is_in_the_hash_and_can_be_turned_off(tiny_vl_dir, hf_tv):
    pre = Preprocessor(tiny_vl_dir, LIMITS, {"image": 1}, processor_cache_bytes=0)
    data = _encode(2600, 1500, "JPEG", seed=5)
    msgs = [{"role": "user", "content": [{"type": "image", "media": MediaRef("image", data=data)}]}]
    drafted = pre.preprocess_sync(msgs).items[0]
    assert drafted.metadata["decoded_size"] == [1300, 750]
    pre.family.jpeg_draft = False
    full = pre.preprocess_sync(msgs).items[0]
    assert full.mm_hash != drafted.mm_hash  # embeddings of one decode are never served for the other
    ref = hf_tv(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")
    assert torch.equal(full.data.tensors["pixel_values"], ref["pixel_values"])


def test_unsupported_processor_settings_fall_back_to_hf(tiny_vl_dir):
    bilinear = AutoImageProcessor.from_pretrained(str(tiny_vl_dir), backend="torchvision", resample=2)
    assert Qwen2VLImageTransform.from_hf(bilinear) is None
    pil = AutoImageProcessor.from_pretrained(str(tiny_vl_dir), backend="pil")
    assert Qwen2VLImageTransform.from_hf(pil) is None
    pre = Preprocessor(tiny_vl_dir, LIMITS, {"image": 1}, processor_cache_bytes=0)
    pre.family.hf.image_processor = bilinear
    pre.family.image_transform = None
    assert pre.family.image_decode_size(2600, 1500) is None  # no draft without the transform
    img = Image.fromarray(make_image_array(200, 120, 1))
    out = pre.family.process("image", img)
    ref = bilinear(images=[img], return_tensors="pt")
    assert torch.equal(out.tensors["pixel_values"], ref["pixel_values"])


def test_transform_refuses_non_rgb_arrays(vl):
    transform = vl.family.image_transform
    assert transform is not None
    with pytest.raises(ValueError, match="expected an RGB image"):
        transform(Image.fromarray(np.zeros((8, 8), dtype=np.uint8)))
