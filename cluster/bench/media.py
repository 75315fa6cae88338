"""Real media generated on the fly (pillow, PyAV, soundfile): benchmark and tests use it; nothing binary is committed."""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image


def make_image_array(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A smooth RGB pattern plus noise: compresses like a photo, differs per seed."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = rng.uniform(0, 2 * math.pi, size=3)
    channels = [127 + 100 * np.sin(x / (7 + 3 * c) + y / (11 + c) + phase[c]) for c in range(3)]
    img = np.stack(channels, axis=-1) + rng.normal(0, 8, size=(height, width, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def make_image_bytes(width: int = 64, height: int = 48, fmt: str = "PNG", seed: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(make_image_array(width, height, seed)).save(buf, format=fmt)
    return buf.getvalue()


def make_video_bytes(
    width: int = 64,
    height: int = 48,
    num_frames: int = 8,
    fps: int = 4,
    seed: int = 0,
    container: str = "mp4",
) -> bytes:
    """An H.264 MP4 (or VP9 WebM) whose frames drift so that consecutive frames differ."""
    import av

    buf = io.BytesIO()
    codec = "libx264" if container == "mp4" else "libvpx-vp9"
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        base = make_image_array(width + num_frames * 2, height, seed)
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(
                np.ascontiguousarray(base[:, i * 2 : i * 2 + width]), format="rgb24"
            )
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def make_audio_array(seconds: float = 1.0, sr: int = 16000, freq: float = 440.0, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr), dtype=np.float32) / sr
    wave = 0.5 * np.sin(2 * np.pi * freq * t) + 0.05 * rng.standard_normal(t.shape).astype(np.float32)
    return wave.astype(np.float32)


def make_audio_bytes(
    seconds: float = 1.0, sr: int = 16000, fmt: str = "WAV", freq: float = 440.0, seed: int = 0
) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, make_audio_array(seconds, sr, freq, seed), sr, format=fmt)
    return buf.getvalue()
