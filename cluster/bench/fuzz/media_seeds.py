"""Seeds of the media targets (image, video, audio), made with Pillow, PyAV and soundfile, and the small
media the other seeds embed (``cluster/bench/fuzz/seeds.py`` writes them all)."""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np


def _png(w: int = 16, h: int = 16) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 60)).save(buf, "PNG")
    return buf.getvalue()


def image_seeds() -> dict[str, bytes]:
    from PIL import Image

    rng = np.random.default_rng(0)
    noise = Image.fromarray(rng.integers(0, 255, (32, 48, 3), dtype=np.uint8))
    out = {}
    for fmt, ext, mode in (
        ("PNG", "png", "RGB"),
        ("JPEG", "jpg", "RGB"),
        ("GIF", "gif", "P"),
        ("WEBP", "webp", "RGB"),
        ("BMP", "bmp", "RGB"),
        ("PNG", "la.png", "LA"),
        ("JPEG", "cmyk.jpg", "CMYK"),
    ):
        buf = io.BytesIO()
        noise.convert(mode).save(buf, fmt)
        out[f"noise.{ext}"] = buf.getvalue()
    big = io.BytesIO()
    Image.new("L", (400, 300)).save(big, "PNG")  # 120,000 pixels: past the target's max_pixels
    out["over_max_pixels.png"] = big.getvalue()
    png = bytearray(_png())
    png[16:24] = (30000).to_bytes(4, "big") + (30000).to_bytes(4, "big")  # IHDR lies about its size
    out["lying_header.png"] = bytes(png)
    out["truncated.jpg"] = out["noise.jpg"][: len(out["noise.jpg"]) // 2]
    return out


def _video(
    container: str, codec: str, w: int = 32, h: int = 24, n: int = 6, pix_fmt: str = "yuv420p"
) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=4)
        stream.width, stream.height, stream.pix_fmt = w, h, pix_fmt
        stream.time_base = Fraction(1, 4)
        for i in range(n):
            img = np.full((h, w, 3), (10 + 30 * i) % 256, np.uint8)
            img[: h // 2, : w // 2] = (255 - 30 * i) % 256
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            frame.pts = i
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return buf.getvalue()


def video_seeds() -> dict[str, bytes]:
    out = {
        "h264.mp4": _video("mp4", "libx264"),
        "mpeg4.avi": _video("avi", "mpeg4"),
        "vp9.webm": _video("webm", "libvpx-vp9"),
        "mjpeg.mkv": _video("matroska", "mjpeg", pix_fmt="yuvj420p"),
        "mpeg2.ts": _video("mpegts", "mpeg2video"),
        "too_many_frames.mp4": _video("mp4", "mpeg4", w=16, h=16, n=40),
    }
    out["truncated.mp4"] = out["h264.mp4"][: len(out["h264.mp4"]) * 2 // 3]
    return out


def _sine(rate: int, seconds: float, channels: int = 1) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    wave = (np.sin(2 * np.pi * 440 * t) * 0.3).astype(np.float32)
    return np.repeat(wave[:, None], channels, axis=1)


def _soundfile(fmt: str, subtype: str, rate: int, seconds: float, channels: int = 1) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, _sine(rate, seconds, channels), rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def _av_audio(container: str, codec: str, rate: int, seconds: float) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(_sine(rate, seconds).T.copy(), format="fltp", layout="mono")
        frame.sample_rate = rate
        out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return buf.getvalue()


def audio_seeds() -> dict[str, bytes]:
    return {
        "pcm16.wav": _soundfile("WAV", "PCM_16", 8000, 0.25),
        "float_stereo.wav": _soundfile("WAV", "FLOAT", 8000, 0.1, channels=2),
        "u8.wav": _soundfile("WAV", "PCM_U8", 16000, 0.2),
        "pcm16.flac": _soundfile("FLAC", "PCM_16", 22050, 0.2),
        "vorbis.ogg": _soundfile("OGG", "VORBIS", 16000, 0.3),
        "mp3.mp3": _av_audio("mp3", "libmp3lame", 16000, 0.3),
        "alaw_in_wav.wav": _soundfile("WAV", "ALAW", 8000, 0.1),
    }
