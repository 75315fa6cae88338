"""Hostile and ordinary media made in the test (PyAV, soundfile), and checks that each is what it claims.

The generators are imported by the other ``test_media_*`` modules; the tests here make sure a sample
really has the property a defect needs (a stream that really switches resolution, a FLAC header that
really claims 655,350 Hz x 8 channels), so the tests using them cannot pass vacuously.
"""

from __future__ import annotations

import functools
import io

import av
import numpy as np
import soundfile as sf


def _grey_frames(width: int, height: int, count: int, start: int = 0) -> list[av.VideoFrame]:
    return [
        av.VideoFrame.from_ndarray(
            np.full((height, width, 3), 10 + 20 * (start + i), np.uint8), format="rgb24"
        )
        for i in range(count)
    ]


def _encode_segment(
    width: int, height: int, count: int, start: int, container: str, codec: str, ts_offset: float | None
) -> bytes:
    buf = io.BytesIO()
    opts = {"output_ts_offset": str(ts_offset)} if ts_offset else {}
    with av.open(buf, "w", format=container, container_options=opts) as out:
        out.metadata["title"] = "Q" * 4
        stream = out.add_stream(codec, rate=4)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for frame in _grey_frames(width, height, count, start):
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return buf.getvalue()


def encode_video(
    segments: list[tuple[int, int, int]],
    *,
    container: str = "mpegts",
    codec: str = "libx264",
    title: bytes | None = None,
) -> bytes:
    """Frames of flat grey ``10 + 20 * i`` at 4 fps; several ``(w, h, frames)`` segments are encoded
    separately and concatenated (MPEG-TS allows that), so the resolution switches between them."""
    return _encode_video(tuple(segments), container, codec, title)


@functools.cache
def _encode_video(
    segments: tuple[tuple[int, int, int], ...], container: str, codec: str, title: bytes | None
) -> bytes:
    parts, start, offset = [], 0, 0.0
    for w, h, n in segments:
        parts.append(_encode_segment(w, h, n, start, container, codec, offset or None))
        start, offset = start + n, offset + n / 4
    data = b"".join(parts)
    if title is not None:
        assert len(title) == 4 and data.count(b"QQQQ") == 1
        data = data.replace(b"QQQQ", title)
    return data


def encode_audio(fmt: str, codec: str, *, rate: int, seconds: float) -> tuple[bytes, np.ndarray]:
    """A mono 440 Hz sine (amplitude 0.3) encoded with PyAV; returns the bytes and the float signal."""
    t = np.arange(int(rate * seconds)) / rate
    signal = (np.sin(2 * np.pi * 440 * t) * 0.3).astype(np.float32)
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(signal[None], format="flt", layout="mono")
        frame.sample_rate = rate
        out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return buf.getvalue(), signal


@functools.cache
def flac_bomb(
    rate: int = 655_350, channels: int = 8, seconds: float = 29.0, *, hide_length: bool = False
) -> bytes:
    """Silence at an absurd rate and channel count: ~165 KB that decodes to ~150 M samples.

    ``hide_length`` zeroes STREAMINFO's total-samples field ("unknown"), so only counting while
    decoding can catch it.
    """
    buf = io.BytesIO()
    frames = int(rate * seconds)
    block = np.zeros((1 << 16, channels), np.int16)
    with sf.SoundFile(buf, "w", samplerate=rate, channels=channels, format="FLAC", subtype="PCM_16") as f:
        for i in range(0, frames, block.shape[0]):
            f.write(block[: min(block.shape[0], frames - i)])
    data = bytearray(buf.getvalue())
    if hide_length:  # STREAMINFO starts at byte 8; total samples are the low 36 bits of bytes 18..25
        data[21] &= 0xF0
        data[22:26] = b"\0\0\0\0"
    return bytes(data)


# ---- the samples are what they claim ---------------------------------------------------------------


def test_switching_stream_really_switches_resolution():
    data = encode_video([(64, 64, 4), (3840, 2160, 2)])
    with av.open(io.BytesIO(data), format="mpegts") as c:
        stream = c.streams.video[0]
        assert (stream.codec_context.width, stream.codec_context.height) == (64, 64)  # the header
        sizes = [(f.width, f.height) for f in c.decode(stream)]
    assert sizes == [(64, 64)] * 4 + [(3840, 2160)] * 2 and len(data) < 100_000


def test_flac_bomb_is_small_and_claims_what_it_decodes_to():
    data = flac_bomb()
    info = sf.info(io.BytesIO(data))
    assert len(data) < 200_000 and info.samplerate == 655_350 and info.channels == 8
    assert info.frames * info.channels > 150_000_000
    hidden = sf.info(io.BytesIO(flac_bomb(hide_length=True)))
    assert hidden.frames >= 2**62 and hidden.samplerate == 655_350  # libsndfile: length unknown


def test_video_title_bytes_replaced():
    data = encode_video([(32, 32, 2)], container="matroska", title=b"\xff\xfe\xfd\xfc")
    assert b"\xff\xfe\xfd\xfc" in data
