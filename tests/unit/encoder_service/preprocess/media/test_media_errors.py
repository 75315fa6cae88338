"""One mapping (issue 11, item 9): whatever a decoder raises on client bytes becomes a 4xx naming the item.

``errors.decoder_error`` is the single place; ``loader.decode_media`` applies it around every decoder.
The exceptions below are the real classes the decoders raise (PyAV, soundfile, librosa, PIL, stdlib).
"""

from __future__ import annotations

import asyncio
import io
import struct

import av
import librosa
import numpy as np
import pytest
import soundfile as sf
from PIL import UnidentifiedImageError

from encoder_service.preprocess.errors import (
    InvalidMediaInput,
    MediaDecodeError,
    MediaError,
    MediaTooLarge,
    UnsupportedMediaType,
    decoder_error,
    decoding,
)
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.media.fetch import FetchedMedia
from encoder_service.preprocess.media.loader import decode_media
from tests.media import make_audio_bytes, make_image_bytes, make_video_bytes


def _unicode_error() -> UnicodeDecodeError:
    try:
        b"\xff".decode("utf-8")
    except UnicodeDecodeError as e:
        return e
    raise AssertionError


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (AttributeError("'NoneType' object has no attribute 'width'"), MediaDecodeError),
        (_unicode_error(), MediaDecodeError),
        (av.error.InvalidDataError(1094995529, "Invalid data found when processing input"), MediaDecodeError),
        (av.error.EOFError(541478725, "End of file"), MediaDecodeError),
        (av.error.PatchWelcomeError(1163346256, "Not yet implemented in FFmpeg"), UnsupportedMediaType),
        (sf.LibsndfileError(1, "Error opening: "), MediaDecodeError),
        (librosa.ParameterError("Audio buffer is not finite everywhere"), MediaDecodeError),
        (struct.error("unpack requires a buffer of 4 bytes"), MediaDecodeError),
        (OSError("image file is truncated"), MediaDecodeError),
        (ValueError("tile cannot extend outside image"), MediaDecodeError),
        (RecursionError("maximum recursion depth exceeded"), MediaDecodeError),
        (NotImplementedError("mode P;4"), UnsupportedMediaType),
        (UnidentifiedImageError("cannot identify image file"), UnsupportedMediaType),
        (MemoryError(), MediaTooLarge),
    ],
)
def test_decoder_exception_maps_to_a_4xx_naming_the_item(exc, expected):
    err = decoder_error(exc, "video 3", 3)
    assert type(err) is expected and 400 <= err.status_code < 500
    assert err.item == 3 and err.message.startswith("video 3: ")
    with pytest.raises(expected) as caught, decoding("video 3", 3):
        raise exc
    assert caught.value.__cause__ is exc  # the original stays chained for the log


def test_our_own_errors_pass_through_and_control_flow_is_not_swallowed():
    mine = InvalidMediaInput("audio 1: no", item=1)
    assert decoder_error(mine, "audio 1", 1) is mine
    with pytest.raises(InvalidMediaInput) as e, decoding("audio 1", 1):
        raise mine
    assert e.value is mine
    for control in (KeyboardInterrupt(), asyncio.CancelledError(), SystemExit(1)):
        with pytest.raises(type(control)), decoding("audio 1", 1):
            raise control


def _cut(data: bytes, n: int) -> bytes:
    return data[:n]


@pytest.mark.parametrize(
    ("modality", "data"),
    [
        ("image", _cut(make_image_bytes(64, 48, fmt="JPEG"), 30)),  # OSError from PIL was a 500
        ("image", _cut(make_image_bytes(64, 48), 60)),
        ("video", _cut(make_video_bytes(64, 48, num_frames=4, fps=4), 200)),
        ("video", _cut(make_video_bytes(64, 48, num_frames=4, fps=4, container="webm"), 150)),
        ("audio", _cut(make_audio_bytes(0.5, fmt="FLAC"), 50)),
        ("audio", _cut(make_audio_bytes(0.5, fmt="OGG"), 80)),
        ("audio", _cut(make_audio_bytes(0.5, fmt="MP3"), 3)),
        ("audio", b"RIFF\xff\xff\xff\xffWAVEfmt \x10\x00\x00\x00" + b"\x00" * 16),
    ],
)
def test_truncated_media_is_a_4xx_naming_the_item(modality, data):
    with pytest.raises(MediaError) as e:
        decode_media(modality, FetchedMedia(data, "bytes"), MediaLimits(), item=7)
    assert 400 <= e.value.status_code < 500 and e.value.item == 7
    assert e.value.message.startswith(f"{modality} 7: ")


def test_float_audio_with_non_finite_samples_is_422():
    buf = io.BytesIO()
    wave = np.zeros(1600, np.float32)
    wave[100] = np.nan
    sf.write(buf, wave, 16000, format="WAV", subtype="FLOAT")
    with pytest.raises(MediaDecodeError, match="non-finite") as e:
        decode_media("audio", FetchedMedia(buf.getvalue(), "bytes"), MediaLimits(), item=1)
    assert e.value.status_code == 422 and e.value.item == 1


def test_finite_float_audio_that_overflows_when_resampled_is_422():
    # found by the audio fuzz target (cluster/bench/fuzz): 3e38 is finite, its resampled neighbours
    # are not, and the infinities were handed to the feature extractor
    buf = io.BytesIO()
    sf.write(buf, np.full(800, 3e38, np.float32), 8000, format="WAV", subtype="FLOAT")
    with pytest.raises(MediaDecodeError, match="overflow when resampled") as e:
        decode_media("audio", FetchedMedia(buf.getvalue(), "bytes"), MediaLimits(), item=2)
    assert e.value.status_code == 422 and e.value.item == 2


def test_a_video_codec_without_a_decoder_is_415_not_our_attribute_error():
    # found by the video fuzz target: an unknown sample entry leaves PyAV's stream without a codec
    # context, and reading its width was an AttributeError (a 422 that hid our bug)
    data = make_video_bytes(container="mp4").replace(b"avc1", b"qqqq")
    with pytest.raises(UnsupportedMediaType, match="codec has no decoder") as e:
        decode_media("video", FetchedMedia(data, "bytes"), MediaLimits(), item=3)
    assert e.value.status_code == 415 and e.value.__cause__ is None
