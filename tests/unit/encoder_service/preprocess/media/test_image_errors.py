"""Bad image input is the client's 4xx naming the item, never a 500 — through the Preprocessor."""

from __future__ import annotations

import io
import struct
import zlib

import pytest
from PIL import Image

from cluster.bench.media import make_image_array, make_image_bytes
from encoder_service.preprocess.errors import (
    MediaDecodeError,
    MediaError,
    MediaTooLarge,
    UnsupportedMediaType,
)
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.media.image import decode_image, decode_image_scaled
from encoder_service.preprocess.processing import Preprocessor
from encoder_service.types import MediaRef
from tests.tiny_dirs import tiny_model_dir

LIMITS = MediaLimits(max_pixels=4096 * 4096)


@pytest.fixture(scope="module", params=["qwen2-vl", "qwen3.5"])
def vl(request, tiny_vl_dir):
    """The default Qwen2-VL's processor and the hybrid Qwen3.5's: the same refusals for both."""
    model_dir = tiny_vl_dir if request.param == "qwen2-vl" else tiny_model_dir("qwen3.5")
    return Preprocessor(model_dir, LIMITS, {"image": 2}, processor_cache_bytes=0)


def _second_item_error(pre: Preprocessor, bad: bytes) -> MediaError:
    """Send a good image then ``bad``: the error must name item 1."""
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image", "media": MediaRef("image", data=make_image_bytes(32, 32))},
                {"type": "text", "text": "and"},
                {"type": "image", "media": MediaRef("image", data=bad)},
            ],
        }
    ]
    with pytest.raises(MediaError) as e:
        pre.preprocess_sync(msgs)
    err = e.value
    assert err.item == 1 and "image 1" in err.message and 400 <= err.status_code < 500
    assert err.to_dict()["param"] == "media[1]"
    return err


def _save(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` and holds one row of pixel data (a bomb's shape)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * (1 + 3 * width))
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def test_jpeg_cut_to_30_bytes_is_422(vl):
    jpeg = make_image_bytes(64, 48, fmt="JPEG")
    err = _second_item_error(vl, jpeg[:30])
    assert isinstance(err, MediaDecodeError) and err.status_code == 422


@pytest.mark.parametrize("cut", [0.3, 0.6, 0.95])
def test_truncated_png_and_jpeg_are_422(vl, cut):
    for fmt in ("PNG", "JPEG"):
        data = make_image_bytes(200, 150, fmt=fmt)
        err = _second_item_error(vl, data[: int(len(data) * cut)])
        assert isinstance(err, MediaDecodeError), (fmt, cut, err)


@pytest.mark.parametrize("fmt", ["PPM", "IM", "SGI", "DDS", "TIFF", "ICO", "TGA"])
def test_formats_outside_the_allow_list_are_415(vl, fmt):
    mode = "RGBA" if fmt == "DDS" else "RGB"
    data = _save(Image.fromarray(make_image_array(16, 16)).convert(mode), fmt)
    assert Image.open(io.BytesIO(data)).format == fmt  # a real file PIL itself would open
    err = _second_item_error(vl, data)
    assert isinstance(err, UnsupportedMediaType) and err.status_code == 415


@pytest.mark.parametrize(
    "body",
    [
        b"P6\n99999999 1\n255\n\x00",  # PPM: ValueError in Pillow before the allow-list
        b"P6\n2 2\n0\n",  # PPM maxval 0
        b"\x01\xda\x01\x01\x00\x03\x00\x01\x00\x01\x00\x04",  # SGI header, no data
        b"DDS |\x00\x00\x00" + b"\x00" * 120,  # DDS with an unknown pixel format
        b"Image type: RGB image\r\nName: x\r\n\x1a",  # IM without a size
    ],
)
def test_fuzz_cases_of_other_plugins_are_415(vl, body):
    err = _second_item_error(vl, body)
    assert isinstance(err, UnsupportedMediaType)


def test_aspect_ratio_over_200_is_422_before_the_processor(vl):
    data = _save(Image.new("RGB", (1, 300), "red"), "PNG")
    calls = vl.num_processor_calls
    looked_up: list[list[str]] = []
    with pytest.raises(MediaDecodeError) as e:
        vl.preprocess_sync(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "media": MediaRef("image", data=make_image_bytes(32, 32))},
                        {"type": "image", "media": MediaRef("image", data=data)},
                    ],
                }
            ],
            lambda hashes: looked_up.append(hashes) or {},
        )
    assert e.value.status_code == 422 and e.value.item == 1
    assert "image 1" in e.value.message and "aspect ratio 300.0" in e.value.message
    assert vl.num_processor_calls == calls and looked_up == []  # refused at the header, before any work


def test_pixel_limit_from_the_header_before_decoding(vl):
    err = _second_item_error(vl, _png_header(5000, 5000))  # 25 M > max_pixels, no pixel data at all
    assert isinstance(err, MediaTooLarge) and err.status_code == 413 and "25000000 pixels" in err.message
    # beyond PIL's own bomb guard (2 x MAX_IMAGE_PIXELS): PIL raises in open(), still our 413
    err = _second_item_error(vl, _png_header(20000, 20000))
    assert isinstance(err, MediaTooLarge)


def test_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (20, 10), c) for c in ("red", "blue")]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    decoded = decode_image_scaled(buf.getvalue(), LIMITS)
    assert decoded.format == "GIF" and decoded.image.getpixel((5, 5)) == (255, 0, 0)


def test_decode_image_keeps_its_contract():
    """``decode_image`` (the media loader's entry) returns a full-size RGB image and its metadata."""
    img, meta = decode_image(make_image_bytes(40, 30, fmt="WEBP"), LIMITS, item=3)
    assert img.mode == "RGB" and img.size == (40, 30)
    assert meta == {"width": 40, "height": 30, "format": "WEBP"}
    with pytest.raises(MediaDecodeError) as e:
        decode_image(make_image_bytes(40, 30, fmt="JPEG")[:30], LIMITS, item=3, label="image 3")
    assert e.value.item == 3 and e.value.message.startswith("image 3:")
