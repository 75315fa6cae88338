"""Audio bytes (WAV/FLAC/OGG/MP3) → mono float32 at the model's sampling rate."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from encoder_service.errors import MediaDecodeError, MediaTooLarge, UnsupportedMediaType
from encoder_service.media.limits import MediaLimits


def _too_long(label: str, seconds: float, limits: MediaLimits, item: int | None) -> MediaTooLarge:
    return MediaTooLarge(
        f"{label}: {seconds:.2f} s of audio exceeds max_audio_seconds={limits.max_audio_seconds}", item=item
    )


def decode_audio(
    data: bytes,
    limits: MediaLimits,
    sampling_rate: int,
    *,
    item: int | None = None,
    label: str = "audio",
) -> tuple[np.ndarray, dict[str, Any]]:
    """Duration is read from the header (soundfile) and refused before the samples are decoded."""
    import soundfile as sf

    try:
        info = sf.info(io.BytesIO(data))
    except sf.LibsndfileError:
        info = None
    if info is not None:
        seconds = info.frames / info.samplerate if info.samplerate else 0.0
        if seconds > limits.max_audio_seconds:
            raise _too_long(label, seconds, limits, item)
        try:
            wave, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
        except (sf.LibsndfileError, RuntimeError) as e:
            raise MediaDecodeError(f"{label}: audio data does not decode ({e})", item=item) from e
        wave = wave.mean(axis=1)
        fmt = info.format
    else:
        wave, sr, fmt = _decode_with_av(data, limits, item, label)
    seconds = len(wave) / sr if sr else 0.0
    if seconds > limits.max_audio_seconds:
        raise _too_long(label, seconds, limits, item)
    if sr != sampling_rate:
        import librosa

        wave = librosa.resample(wave, orig_sr=sr, target_sr=sampling_rate)
    meta = {"seconds": round(seconds, 3), "orig_sampling_rate": int(sr), "format": fmt}
    return np.ascontiguousarray(wave, dtype=np.float32), meta


def _decode_with_av(
    data: bytes, limits: MediaLimits, item: int | None, label: str
) -> tuple[np.ndarray, int, str]:
    """Formats libsndfile does not read (e.g. MP3 on old libsndfile, AAC): PyAV, stopping at the limit."""
    import av

    try:
        container = av.open(io.BytesIO(data))
    except (av.error.InvalidDataError, av.error.FFmpegError) as e:
        raise UnsupportedMediaType(f"{label}: not a recognised audio format", item=item) from e
    with container:
        if not container.streams.audio:
            raise UnsupportedMediaType(f"{label}: no audio stream", item=item)
        stream = container.streams.audio[0]
        sr = int(stream.rate)
        limit = int(limits.max_audio_seconds * sr) + 1
        parts, n = [], 0
        try:
            for frame in container.decode(stream):
                raw = frame.to_ndarray()
                arr = raw.astype(np.float32)
                if np.issubdtype(raw.dtype, np.integer):
                    arr /= float(np.iinfo(raw.dtype).max) + 1.0
                if frame.format.is_planar:
                    arr = arr.mean(axis=0)
                else:
                    arr = arr.reshape(-1, len(frame.layout.channels)).mean(axis=1)
                parts.append(arr)
                n += arr.shape[0]
                if n > limit:
                    raise _too_long(label, n / sr, limits, item)
        except av.error.FFmpegError as e:
            raise MediaDecodeError(f"{label}: audio data does not decode ({e})", item=item) from e
    wave = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    return wave, sr, container.format.name
