"""Target: video bytes -> sampled RGB frames through ``decode_media`` (container sniffing, PyAV with
the demuxer named, the per-frame, decoded-pixel, seconds and frame-count limits). Expected: a
``uint8 [T, H, W, 3]`` array within the limits, or a ``MediaError``."""

from __future__ import annotations

import numpy as np

from cluster.bench.fuzz.outcomes import check_cause
from encoder_service.preprocess.errors import MediaError
from encoder_service.preprocess.media.fetch import FetchedMedia
from encoder_service.preprocess.media.limits import MediaLimits
from encoder_service.preprocess.media.loader import decode_media

# small limits: each input decodes fast, and the limits are reached (they are what is under test)
LIMITS = MediaLimits(
    max_video_frames=16,
    max_video_seconds=30.0,
    max_video_pixels_per_frame=128 * 128,
    max_video_decoded_pixels=128 * 128 * 64,
)


def one_input(data: bytes) -> None:
    frame_multiple = 2 if len(data) % 2 else 1  # Qwen2-VL's temporal patch, or none
    try:
        loaded = decode_media(
            "video", FetchedMedia(data, "bytes"), LIMITS, item=0, frame_multiple=frame_multiple
        )
    except MediaError as e:
        check_cause(e)
        return
    frames = loaded.value
    assert isinstance(frames, np.ndarray)
    t, h, w, c = frames.shape
    if frames.dtype != np.uint8 or c != 3 or not 0 < t <= LIMITS.max_video_frames or t % frame_multiple:
        raise AssertionError(f"decoded {frames.dtype} {frames.shape}")
    if h * w > LIMITS.max_video_pixels_per_frame:
        raise AssertionError(f"a {w}x{h} frame passed max_video_pixels_per_frame")
