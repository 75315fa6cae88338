"""``MediaLimits``: the frozen, service-side mirror of ``cluster.config.MediaLimitsConfig``."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, cast


class _Config(Protocol):
    """A pydantic model with ``MediaLimits``' fields (``cluster.config.MediaLimitsConfig``)."""

    def model_dump(self) -> Mapping[str, object]: ...


@dataclass(frozen=True)
class MediaLimits:
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 4096 * 4096
    max_video_frames: int = 64
    max_video_seconds: float = 600.0
    max_video_pixels_per_frame: int = 1920 * 1080
    # pixels summed over EVERY decoded frame (sampled or not): bounds decoding work; 4,096 1080p frames
    max_video_decoded_pixels: int = 1920 * 1080 * 4096
    video_num_frames: int | None = None  # sample exactly this many frames
    video_fps: float = 2.0  # else sample at this rate
    max_audio_seconds: float = 30.0
    # decoded samples per second of audio, all channels: 48 kHz x 8 channels, or 192 kHz x 2. The budget
    # is max_audio_seconds x this, counted while decoding (a 655 kHz x 8-channel FLAC is refused)
    max_audio_samples_per_second: int = 48_000 * 8
    fetch_timeout_s: float = 10.0
    # one host-name lookup (one redirect hop), waiting for a thread of the lookup pool included
    # (dns_pool.py); service-side only, like max_redirects
    dns_timeout_s: float = 5.0
    allowed_domains: tuple[str, ...] | None = None
    allow_private_addresses: bool = False
    allowed_local_media_path: str | None = None
    max_redirects: int = 5

    @property
    def max_audio_samples(self) -> int:
        """Decoded samples (frames x channels) one audio item may produce."""
        return int(self.max_audio_seconds * self.max_audio_samples_per_second)

    @classmethod
    def from_config(cls, cfg: _Config | dict[str, object]) -> MediaLimits:
        """Build from a ``MediaLimitsConfig`` (or anything with its fields, e.g. a dict)."""
        raw = cfg if isinstance(cfg, dict) else cfg.model_dump()
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in names}
        domains = kwargs.get("allowed_domains")
        if domains is not None:
            kwargs["allowed_domains"] = tuple(cast("Iterable[str]", domains))
        return cls(**kwargs)  # type: ignore[arg-type]  # each value as the config gives it, unchecked
