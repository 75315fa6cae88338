"""Property-based fuzzing of the image path: random bytes, mutated and truncated files of every accepted
format. Every outcome is a processed item or the project's own ``MediaError`` with a 4xx naming the
item — never another exception. Seeds are small valid files made here."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from cluster.bench.media import make_image_array
from encoder_service.preprocess.errors import MediaError
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.media.image import ALLOWED_IMAGE_FORMATS, decode_image_scaled
from encoder_service.preprocess.processing import Preprocessor
from encoder_service.types import MediaRef
from tests.tiny_dirs import tiny_model_dir

# Mutations may declare large sizes; this bound keeps a decode (and the test's memory) small.
LIMITS = MediaLimits(max_pixels=512 * 512)
FUZZ = settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _seed(fmt: str, mode: str, size: tuple[int, int] = (19, 13), **save: Any) -> bytes:
    img = Image.fromarray(make_image_array(*size, seed=len(fmt) + len(mode))).convert(mode)
    buf = io.BytesIO()
    img.save(buf, fmt, **save)
    return buf.getvalue()


def _animated_gif() -> bytes:
    frames = [Image.new("P", (9, 7), i) for i in (1, 2, 3)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=10)
    return buf.getvalue()


def _mpo() -> bytes:
    pictures = [Image.fromarray(make_image_array(11, 9, seed)) for seed in (1, 2)]
    buf = io.BytesIO()
    pictures[0].save(buf, "MPO", save_all=True, append_images=pictures[1:])
    return buf.getvalue()


SEEDS: list[bytes] = [
    _seed("JPEG", "RGB", quality=70),
    _seed("JPEG", "L"),
    _seed("JPEG", "RGB", progressive=True),
    _seed("JPEG", "CMYK"),
    _mpo(),
    _seed("PNG", "RGB"),
    _seed("PNG", "RGBA"),
    _seed("PNG", "P"),
    _seed("PNG", "1"),
    _seed("PNG", "I;16"),
    _seed("PNG", "RGB", size=(8, 8), optimize=True),
    _seed("WEBP", "RGB", quality=60),
    _seed("WEBP", "RGBA", lossless=True),
    _seed("GIF", "P"),
    _animated_gif(),
    _seed("BMP", "RGB"),
    _seed("BMP", "P"),
    _seed("BMP", "1"),
]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A seed file with a few bytes overwritten, inserted or deleted, then maybe truncated."""
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 6))):
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        op = draw(st.sampled_from(["set", "insert", "delete", "header"]))
        if op == "set" and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 16))]
        else:  # headers carry sizes, lengths and offsets: hit them more often
            at = draw(st.integers(0, min(len(data), 64)))
            data[at : at + 4] = draw(st.binary(min_size=4, max_size=4))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


@st.composite
def truncated(draw: st.DrawFn) -> bytes:
    data = draw(st.sampled_from(SEEDS))
    return data[: draw(st.integers(0, len(data) - 1))]


@st.composite
def magic_then_noise(draw: st.DrawFn) -> bytes:
    """A recognised signature followed by random bytes: the parser gets past identification."""
    magic = draw(
        st.sampled_from(
            [b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"RIFF\x00\x00\x00\x00WEBP", b"GIF89a", b"BM"]
        )
    )
    return magic + draw(st.binary(max_size=300))


class Family(NamedTuple):
    pre: Preprocessor
    patch_width: int  # one flattened patch: channels x temporal patch x patch x patch


@pytest.fixture(scope="module", params=["qwen2-vl", "qwen3.5"])
def vl(request, tiny_vl_dir):
    """Each family's own processor under the fuzz: the default Qwen2-VL and the hybrid Qwen3.5."""
    model_dir = tiny_vl_dir if request.param == "qwen2-vl" else tiny_model_dir("qwen3.5")
    cfg = json.loads((Path(model_dir) / "processor_config.json").read_text())["image_processor"]
    pre = Preprocessor(model_dir, LIMITS, {"image": 1}, processor_cache_bytes=0)
    return Family(pre, 3 * cfg["temporal_patch_size"] * cfg["patch_size"] ** 2)


def _check(vl: Family, data: bytes) -> None:
    msgs = [{"role": "user", "content": [{"type": "image", "media": MediaRef("image", data=data)}]}]
    try:
        out = vl.pre.preprocess_sync(msgs)
    except MediaError as e:
        assert 400 <= e.status_code < 500 and e.item == 0 and "image 0" in e.message, e
        return
    (item,) = out.items
    pixels = item.data.tensors["pixel_values"]
    assert item.length * 4 == pixels.shape[0] and pixels.shape[1] == vl.patch_width


def test_seeds_decode(vl):
    for data in SEEDS:
        decoded = decode_image_scaled(data, LIMITS)
        assert decoded.format in (*ALLOWED_IMAGE_FORMATS, "MPO") and decoded.image.mode == "RGB"
        _check(vl, data)


@FUZZ
@given(data=mutated())
def test_mutated_files(vl, data):
    _check(vl, data)


@FUZZ
@given(data=truncated())
def test_truncated_files(vl, data):
    _check(vl, data)


@FUZZ
@given(data=st.one_of(st.binary(max_size=400), magic_then_noise()))
def test_random_bytes(vl, data):
    _check(vl, data)
