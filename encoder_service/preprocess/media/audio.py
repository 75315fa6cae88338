"""Audio bytes (WAV, FLAC, MP3, Ogg) → mono float32 at the model's sampling rate.

Decoding streams block by block into a ``_MonoSink`` that downmixes, resamples (soxr, the resampler
``librosa.resample`` uses) and counts as it goes, so memory stays at the mono output whatever the
source's rate and channel count. The budget is in decoded samples, rate × channels × seconds
(``MediaLimits.max_audio_samples``), checked from the header when it declares a length and again
while decoding, since a header may leave the length out or lie.
"""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING

import numpy as np

from encoder_service.preprocess.errors import MediaDecodeError, MediaTooLarge, UnsupportedMediaType
from encoder_service.preprocess.media.containers import AUDIO_CONTAINERS, open_container, require_container
from encoder_service.preprocess.media.decoded import MediaMetadata
from encoder_service.preprocess.media.limits import MediaLimits

if TYPE_CHECKING:
    import soxr
    from av.audio.frame import AudioFrame

_BLOCK_SAMPLES = 1 << 17  # samples (frames x channels) per soundfile read: 512 KB of float32
# what libsndfile calls each accepted container
_SF_FORMATS = {"wav": ("WAV", "WAVEX", "RF64"), "flac": ("FLAC",), "ogg": ("OGG",), "mp3": ("MP3",)}


class _MonoSink:
    """Takes ``[frames, channels]`` float32 blocks; keeps mono at ``target_sr``; enforces the budgets."""

    def __init__(self, limits: MediaLimits, target_sr: int, label: str, item: int | None) -> None:
        self.limits, self.target_sr, self.label, self.item = limits, target_sr, label, item
        self.sr = 0
        self.frames = 0
        self.samples = 0
        self.parts: list[np.ndarray] = []
        self._stream: soxr.ResampleStream | None = None

    def start(self, sr: int, channels: int, declared_frames: int | None) -> None:
        if sr <= 0 or channels <= 0:
            raise MediaDecodeError(f"{self.label}: {sr} Hz, {channels} channels is not audio", item=self.item)
        self.sr = sr
        if declared_frames is not None and 0 < declared_frames < 2**62:
            self._check(declared_frames, declared_frames * channels)
        if sr != self.target_sr:
            import soxr

            self._stream = soxr.ResampleStream(sr, self.target_sr, 1, dtype="float32", quality="HQ")

    def _check(self, frames: int, samples: int) -> None:
        seconds = frames / self.sr
        if seconds > self.limits.max_audio_seconds:
            raise MediaTooLarge(
                f"{self.label}: {seconds:.2f} s of audio exceeds max_audio_seconds="
                f"{self.limits.max_audio_seconds}",
                item=self.item,
            )
        if samples > self.limits.max_audio_samples:
            raise MediaTooLarge(
                f"{self.label}: {samples} decoded samples ({self.sr} Hz x channels x seconds) exceed "
                f"max_audio_samples_per_second={self.limits.max_audio_samples_per_second} x "
                f"max_audio_seconds={self.limits.max_audio_seconds}",
                item=self.item,
            )

    def push(self, block: np.ndarray) -> None:
        """``block``: ``[frames, channels]`` float32 in [-1, 1]."""
        self.frames += block.shape[0]
        self.samples += block.size
        self._check(self.frames, self.samples)
        mono = np.ascontiguousarray(block.mean(axis=1), dtype=np.float32)
        if not np.isfinite(mono).all():  # float PCM may carry NaN/inf: poison for every feature after
            raise MediaDecodeError(
                f"{self.label}: audio holds non-finite samples (NaN or inf)", item=self.item
            )
        if self._stream is not None:
            mono = self._stream.resample_chunk(mono, last=False)
        self.parts.append(mono)

    def finish(self) -> np.ndarray:
        if self._stream is not None:
            self.parts.append(self._stream.resample_chunk(np.zeros(0, np.float32), last=True))
        wave = np.concatenate(self.parts) if self.parts else np.zeros(0, np.float32)
        if self.sr and self.sr != self.target_sr:  # the length librosa.resample(fix=True) gives
            n = math.ceil(self.frames * self.target_sr / self.sr)
            wave = wave[:n] if wave.shape[0] >= n else np.pad(wave, (0, n - wave.shape[0]))
            if not np.isfinite(wave).all():  # finite float samples near float32's max overflow resampling
                raise MediaDecodeError(
                    f"{self.label}: audio samples overflow when resampled (float PCM far outside [-1, 1])",
                    item=self.item,
                )
        return np.ascontiguousarray(wave, dtype=np.float32)


def decode_audio(
    data: bytes,
    limits: MediaLimits,
    sampling_rate: int,
    *,
    item: int | None = None,
    label: str = "audio",
) -> tuple[np.ndarray, MediaMetadata]:
    """Decoder exceptions are left to ``loader.decode_media``'s one mapping (``errors.decoding``)."""
    import soundfile as sf

    fmt = require_container(data, AUDIO_CONTAINERS, "audio", label, item)
    sink = _MonoSink(limits, sampling_rate, label, item)
    try:
        snd = sf.SoundFile(io.BytesIO(data))
    except sf.LibsndfileError:  # a codec libsndfile lacks inside an accepted container: PyAV
        name = _decode_with_av(data, fmt, sink, label, item)
    else:
        with snd:
            if snd.format not in _SF_FORMATS[fmt]:
                raise UnsupportedMediaType(f"{label}: {snd.format} data inside a {fmt} container", item=item)
            sink.start(snd.samplerate, snd.channels, snd.frames)
            frames_per_block = max(64, _BLOCK_SAMPLES // snd.channels)  # 1,024 channels stay small
            for block in snd.blocks(blocksize=frames_per_block, dtype="float32", always_2d=True):
                sink.push(block)
            name = snd.format
    wave = sink.finish()
    meta: MediaMetadata = {
        "seconds": round(sink.frames / sink.sr, 3),
        "orig_sampling_rate": sink.sr,
        "format": name,
    }
    return wave, meta


def _decode_with_av(data: bytes, fmt: str, sink: _MonoSink, label: str, item: int | None) -> str:
    with open_container(data, fmt) as container:
        if not container.streams.audio:
            raise UnsupportedMediaType(f"{label}: no audio stream", item=item)
        stream = container.streams.audio[0]
        if stream.codec_context is None:  # a codec id FFmpeg has no decoder for (PyAV gives no context)
            raise UnsupportedMediaType(f"{label}: the audio stream's codec has no decoder here", item=item)
        channels = stream.codec_context.channels
        sink.start(int(stream.rate or 0), channels, None)
        for frame in container.decode(stream):
            if frame.sample_rate != sink.sr or len(frame.layout.channels) != channels:
                raise MediaDecodeError(f"{label}: sample rate or channel count changes mid-stream", item=item)
            sink.push(_frame_to_block(frame, channels))
        return str(container.format.name)


def _frame_to_block(frame: AudioFrame, channels: int) -> np.ndarray:
    """A PyAV audio frame → ``[frames, channels]`` float32 in [-1, 1]."""
    raw = frame.to_ndarray()
    arr = raw.astype(np.float32)
    if np.issubdtype(raw.dtype, np.signedinteger):
        arr /= float(np.iinfo(raw.dtype).max) + 1.0
    elif np.issubdtype(raw.dtype, np.unsignedinteger):  # u8 PCM: 128 is silence
        half = (float(np.iinfo(raw.dtype).max) + 1.0) / 2
        arr = (arr - half) / half
    if frame.format.is_planar:
        return arr.T  # [channels, frames] → [frames, channels]
    return arr.reshape(-1, channels)
