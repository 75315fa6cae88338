"""Property-based fuzzing of the video and audio loaders (issue 11, "done when").

Inputs: random bytes; small valid files of every accepted container (made here) with bytes flipped,
chunks inserted or deleted, truncated; files of the other modality; any claimed content type. The
property: every outcome is a decoded value or the project's own ``MediaError`` with a 4xx status,
never another exception, and the traced peak memory of one item stays under a bound.
"""

from __future__ import annotations

import functools
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from encoder_service.preprocess.errors import MediaError
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.media.fetch import FetchedMedia
from encoder_service.preprocess.media.loader import LoadedMedia, decode_media
from tests.media import make_audio_bytes, make_image_bytes
from tests.unit.encoder_service.preprocess.media.test_media_samples import encode_audio, encode_video

# tight limits keep each example fast; the limits are what is under test, not their defaults
LIMITS = MediaLimits(
    max_video_frames=16,
    max_video_seconds=30.0,
    max_video_pixels_per_frame=256 * 256,
    max_video_decoded_pixels=256 * 256 * 64,
    max_audio_seconds=5.0,
)
PEAK_BOUND = 48 * 2**20  # bytes traced per item (numpy buffers, Python objects)
FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@functools.cache
def video_seeds() -> tuple[bytes, ...]:
    small = [(48, 32, 6)]
    return (
        encode_video(small, container="mp4"),
        encode_video(small, container="mov"),
        encode_video(small, container="webm", codec="libvpx-vp9"),
        encode_video(small, container="matroska"),
        encode_video(small, container="avi", codec="mpeg4"),
        encode_video([(48, 32, 3), (32, 48, 3)], container="mpegts"),
    )


@functools.cache
def audio_seeds() -> tuple[bytes, ...]:
    return (
        make_audio_bytes(0.3, sr=8000, fmt="WAV"),
        make_audio_bytes(0.3, sr=22050, fmt="FLAC"),
        make_audio_bytes(0.3, sr=16000, fmt="MP3"),
        make_audio_bytes(0.3, sr=16000, fmt="OGG"),
        encode_audio("ogg", "libopus", rate=48000, seconds=0.2)[0],
        encode_audio("wav", "adpcm_ms", rate=16000, seconds=0.2)[0],
    )


@st.composite
def mutated(draw: st.DrawFn, seeds: tuple[bytes, ...]) -> bytes:
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(0, 6))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "overwrite"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=64))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 256))]
        elif op == "truncate":
            del data[pos:]
        else:  # overwrite with a "big" value, where length and size fields live
            data[pos : pos + 4] = draw(
                st.sampled_from([b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff", b"\0\0\0\0"])
            )
    return bytes(data)


def _inputs(own: tuple[bytes, ...], other: tuple[bytes, ...]) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=2048),
        st.sampled_from(own),
        mutated(own),
        mutated(own),
        mutated(other),  # the other modality's formats, also mutated
        st.builds(lambda: make_image_bytes(16, 16)),
    )


CONTENT_TYPES = st.sampled_from(
    [None, "video/mp4", "audio/wav", "image/png", "text/html", "application/x-sdp"]
)


def _check(modality: str, data: bytes, ctype: str | None) -> None:
    tracemalloc.start()
    try:
        try:
            got = decode_media(modality, FetchedMedia(data, "bytes", ctype), LIMITS, item=0)
        except MediaError as e:
            assert 400 <= e.status_code < 500, e
            assert e.item == 0 and e.message.startswith(f"{modality} 0: ")
        else:
            assert isinstance(got, LoadedMedia) and isinstance(got.value, np.ndarray)
            if modality == "video":
                assert got.value.ndim == 4 and got.value.shape[0] <= LIMITS.max_video_frames
                assert got.value.shape[1] * got.value.shape[2] <= LIMITS.max_video_pixels_per_frame
            else:
                assert got.value.ndim == 1 and got.value.shape[0] <= 16000 * LIMITS.max_audio_seconds + 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BOUND, f"{modality}: traced peak {peak} bytes"


@pytest.mark.parametrize("seed", range(6))
def test_every_video_seed_decodes(seed):
    got = decode_media("video", FetchedMedia(video_seeds()[seed], "bytes"), LIMITS, item=0)
    assert got.value.ndim == 4 and got.value.shape[0] >= 1


@pytest.mark.parametrize("seed", range(6))
def test_every_audio_seed_decodes(seed):
    got = decode_media("audio", FetchedMedia(audio_seeds()[seed], "bytes"), LIMITS, item=0)
    assert got.value.ndim == 1 and got.value.shape[0] > 0


@FUZZ
@given(data=st.deferred(lambda: _inputs(video_seeds(), audio_seeds())), ctype=CONTENT_TYPES)
def test_video_loader_fuzz(data, ctype):
    _check("video", data, ctype)


@FUZZ
@given(data=st.deferred(lambda: _inputs(audio_seeds(), video_seeds())), ctype=CONTENT_TYPES)
def test_audio_loader_fuzz(data, ctype):
    _check("audio", data, ctype)
