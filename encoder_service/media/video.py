"""Video bytes (MP4, WebM, …) → sampled RGB frames ``[T, H, W, 3]`` uint8, decoded with PyAV.

Frames are sampled uniformly: exactly ``video_num_frames`` when set, else ``duration * video_fps``. The
count is rounded up to a multiple of ``frame_multiple`` (Qwen2-VL's ``temporal_patch_size``), repeating
the last frame when the clip is shorter than that.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np

from encoder_service.errors import MediaDecodeError, MediaTooLarge, UnsupportedMediaType
from encoder_service.media.limits import MediaLimits


def sample_frame_indices(total: int, want: int) -> list[int]:
    """``want`` indices spread uniformly over ``[0, total)`` (repeats allowed when ``want > total``)."""
    if total <= 0 or want <= 0:
        return []
    return [min(total - 1, int(i)) for i in np.linspace(0, total - 1, want).round()]


def num_frames_to_sample(seconds: float, total: int, limits: MediaLimits, frame_multiple: int) -> int:
    if limits.video_num_frames is not None:
        want = limits.video_num_frames
    else:
        want = max(1, min(total, math.floor(seconds * limits.video_fps + 1e-6)))
    return max(frame_multiple, math.ceil(want / frame_multiple) * frame_multiple)


def decode_video(
    data: bytes,
    limits: MediaLimits,
    *,
    frame_multiple: int = 1,
    item: int | None = None,
    label: str = "video",
) -> tuple[np.ndarray, dict[str, Any]]:
    import av

    try:
        container = av.open(io.BytesIO(data))
    except (av.error.InvalidDataError, av.error.FFmpegError) as e:
        raise UnsupportedMediaType(f"{label}: not a recognised video format", item=item) from e
    with container:
        if not container.streams.video:
            raise UnsupportedMediaType(f"{label}: no video stream", item=item)
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        if width * height > limits.max_video_pixels_per_frame:
            raise MediaTooLarge(
                f"{label}: {width}x{height} = {width * height} pixels per frame exceeds "
                f"max_video_pixels_per_frame={limits.max_video_pixels_per_frame}",
                item=item,
            )
        rate = float(stream.average_rate or stream.guessed_rate or 0) or 1.0
        if stream.duration is not None and stream.time_base is not None:
            seconds = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            seconds = container.duration / 1_000_000
        else:
            seconds = (stream.frames or 0) / rate
        if seconds > limits.max_video_seconds:
            raise MediaTooLarge(
                f"{label}: {seconds:.2f} s exceeds max_video_seconds={limits.max_video_seconds}", item=item
            )
        total = stream.frames or max(1, round(seconds * rate))
        want = num_frames_to_sample(seconds, total, limits, frame_multiple)
        if want > limits.max_video_frames:
            raise MediaTooLarge(
                f"{label}: sampling {want} frames exceeds max_video_frames={limits.max_video_frames}",
                item=item,
            )
        frames = _decode_sampled(container, stream, sample_frame_indices(total, want), item, label)
    picked = np.stack(frames)
    meta = {
        "width": width,
        "height": height,
        "seconds": round(seconds, 3),
        "total_frames": total,
        "sampled_frames": int(picked.shape[0]),
        "format": container.format.name,
    }
    return picked, meta


def _decode_sampled(
    container: Any, stream: Any, indices: list[int], item: int | None, label: str
) -> list[np.ndarray]:
    """Decode in order, keeping only the sampled frames (memory stays at ``len(indices)`` frames).

    When the stream holds fewer frames than its header promised, missing picks repeat the last frame.
    """
    import av

    wanted, stop = set(indices), max(indices)
    kept: dict[int, np.ndarray] = {}
    last: np.ndarray | None = None
    try:
        for i, frame in enumerate(container.decode(stream)):
            if i > stop:
                break
            if i in wanted:
                last = kept[i] = frame.to_ndarray(format="rgb24")
    except av.error.FFmpegError as e:
        raise MediaDecodeError(f"{label}: video data does not decode ({e})", item=item) from e
    if last is None:
        raise MediaDecodeError(f"{label}: no frame decodes", item=item)
    out = []
    for i in indices:
        last = kept.get(i, last)
        out.append(last)
    return out
