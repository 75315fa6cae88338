"""Target: audio bytes -> mono float32 at 16 kHz through ``decode_media`` (container sniffing,
libsndfile or PyAV, the seconds and decoded-samples budgets, non-finite samples). Expected: a finite
``float32 [samples]`` within ``max_audio_seconds``, or a ``MediaError``."""

from __future__ import annotations

import numpy as np

from cluster.bench.fuzz.outcomes import check_cause
from encoder_service.preprocess.errors import MediaError
from encoder_service.preprocess.media.fetch import FetchedMedia
from encoder_service.preprocess.media.limits import MediaLimits
from encoder_service.preprocess.media.loader import decode_media

LIMITS = MediaLimits(max_audio_seconds=5.0, max_audio_samples_per_second=48_000 * 2)
SAMPLING_RATE = 16_000


def one_input(data: bytes) -> None:
    try:
        loaded = decode_media(
            "audio", FetchedMedia(data, "bytes"), LIMITS, item=0, sampling_rate=SAMPLING_RATE
        )
    except MediaError as e:
        check_cause(e)
        return
    wave = loaded.value
    assert isinstance(wave, np.ndarray)
    if wave.dtype != np.float32 or wave.ndim != 1 or not np.isfinite(wave).all():
        raise AssertionError(f"decoded {wave.dtype} {wave.shape}, finite: {np.isfinite(wave).all()}")
    if wave.shape[0] > LIMITS.max_audio_seconds * SAMPLING_RATE + 1:
        raise AssertionError(f"{wave.shape[0]} samples passed max_audio_seconds={LIMITS.max_audio_seconds}")
