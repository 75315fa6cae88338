"""Video bytes (MP4/MOV, WebM/Matroska, AVI, MPEG-TS) → sampled RGB frames ``[T, H, W, 3]`` uint8 (PyAV).

Frames are sampled uniformly: exactly ``video_num_frames`` when set, else ``duration * video_fps``. The
count is rounded up to a multiple of ``frame_multiple`` (Qwen2-VL's ``temporal_patch_size``), repeating
the last frame when the clip is shorter than that.

Decompression bombs are stopped while decoding, not only from the header, which a stream may contradict:
the decoder itself refuses a picture over ``max_video_pixels_per_frame`` (FFmpeg's ``max_pixels``), each
decoded frame is checked again, and the pixels of every decoded frame (sampled or not) are summed
against ``max_video_decoded_pixels``. A stream that changes resolution mid-way has its sampled frames
scaled, as they are decoded, to the size the clip started with, so the output is one array.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from encoder_service.preprocess.errors import MediaDecodeError, MediaTooLarge, UnsupportedMediaType
from encoder_service.preprocess.media.containers import VIDEO_CONTAINERS, open_container, require_container
from encoder_service.preprocess.media.decoded import MediaMetadata
from encoder_service.preprocess.media.limits import MediaLimits

if TYPE_CHECKING:
    from av.container import InputContainer
    from av.video.frame import VideoFrame
    from av.video.stream import VideoStream


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


def _frame_too_large(label: str, w: int, h: int, limits: MediaLimits, item: int | None) -> MediaTooLarge:
    return MediaTooLarge(
        f"{label}: {w}x{h} = {w * h} pixels per frame exceeds "
        f"max_video_pixels_per_frame={limits.max_video_pixels_per_frame}",
        item=item,
    )


def target_frame_size(width: int, height: int, max_pixels: int | None) -> tuple[int, int]:
    """``(width, height)`` scaled down, aspect kept, to at most ``max_pixels`` (None: unchanged)."""
    if max_pixels is None or width * height <= max_pixels:
        return width, height
    scale = math.sqrt(max_pixels / (width * height))
    return max(1, math.floor(width * scale)), max(1, math.floor(height * scale))


def _seconds(container: InputContainer, stream: VideoStream, rate: float) -> float:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return float(container.duration) / 1_000_000
    return (stream.frames or 0) / rate


def decode_video(
    data: bytes,
    limits: MediaLimits,
    *,
    frame_multiple: int = 1,
    item: int | None = None,
    label: str = "video",
    max_frame_pixels: int | None = None,
) -> tuple[np.ndarray, MediaMetadata]:
    """Decoder exceptions are left to ``loader.decode_media``'s one mapping (``errors.decoding``).

    ``max_frame_pixels``: what the processor keeps of a frame (e.g. Qwen2-VL video's ``max_pixels``);
    larger frames are scaled down to about that many pixels (area filter) as they are decoded, so the
    sampled array never holds more than the processor will use. None keeps the clip's own size.
    """
    fmt = require_container(data, VIDEO_CONTAINERS, "video", label, item)
    with open_container(data, fmt) as container:
        if not container.streams.video:
            raise UnsupportedMediaType(f"{label}: no video stream", item=item)
        stream = container.streams.video[0]
        if stream.codec_context is None:  # a codec id FFmpeg has no decoder for (PyAV gives no context)
            raise UnsupportedMediaType(f"{label}: the video stream's codec has no decoder here", item=item)
        width, height = stream.codec_context.width, stream.codec_context.height
        if width * height > limits.max_video_pixels_per_frame:
            raise _frame_too_large(label, width, height, limits, item)
        rate = float(stream.average_rate or stream.guessed_rate or 0) or 1.0
        seconds = _seconds(container, stream, rate)
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
        sampler = _FrameSampler(sample_frame_indices(total, want), limits, item, label, max_frame_pixels)
        picked = sampler.run(stream, container)
        name = container.format.name
    height, width = picked.shape[1:3]
    meta: MediaMetadata = {
        "width": int(width),
        "height": int(height),
        "seconds": round(seconds, 3),
        "total_frames": total,
        "sampled_frames": int(picked.shape[0]),
        "fps": rate,  # the stream's frame rate (Qwen3-VL's prompt timestamps are index / fps)
        "format": name,
    }
    return picked, meta


class _FrameSampler:
    """Decode in order, keep the sampled frames in one preallocated array, enforce the pixel budgets.

    Memory stays at one ``[T, H, W, 3]`` array plus the decoder's own frames. When the stream holds
    fewer frames than its header promised, missing picks repeat the last decoded pick.
    """

    def __init__(
        self,
        indices: list[int],
        limits: MediaLimits,
        item: int | None,
        label: str,
        max_frame_pixels: int | None = None,
    ) -> None:
        self.indices, self.limits, self.item, self.label = indices, limits, item, label
        self.max_frame_pixels = max_frame_pixels
        self.slots: dict[int, list[int]] = {}
        for pos, i in enumerate(indices):
            self.slots.setdefault(i, []).append(pos)
        self.out: np.ndarray | None = None
        self.filled = [False] * len(indices)
        self.decoded_pixels = 0

    def run(self, stream: VideoStream, container: InputContainer) -> np.ndarray:
        import av

        per_frame = self.limits.max_video_pixels_per_frame
        # FFmpeg's decoder refuses a larger picture before allocating it (the header may lie)
        stream.codec_context.options = {"max_pixels": str(per_frame)}
        stop = max(self.indices)
        try:
            for i, frame in enumerate(container.decode(stream)):
                self._check(frame.width, frame.height)
                if i in self.slots:
                    self._keep(i, frame)
                if i >= stop:
                    break
        except av.error.FFmpegError:
            w, h = stream.codec_context.width, stream.codec_context.height
            if w * h > per_frame:  # the decoder refused the picture size: say so, 413
                raise _frame_too_large(self.label, w, h, self.limits, self.item) from None
            raise
        return self._result()

    def _check(self, w: int, h: int) -> None:
        if w * h > self.limits.max_video_pixels_per_frame:
            raise _frame_too_large(self.label, w, h, self.limits, self.item)
        self.decoded_pixels += w * h
        if self.decoded_pixels > self.limits.max_video_decoded_pixels:
            raise MediaTooLarge(
                f"{self.label}: decoding needs more than max_video_decoded_pixels="
                f"{self.limits.max_video_decoded_pixels} pixels (summed over decoded frames)",
                item=self.item,
            )

    def _keep(self, i: int, frame: VideoFrame) -> None:
        if self.out is None:
            w, h = target_frame_size(frame.width, frame.height, self.max_frame_pixels)
            self.out = np.empty((len(self.indices), h, w, 3), np.uint8)
        h, w = self.out.shape[1:3]
        if (frame.width, frame.height) != (w, h):  # resolution changed mid-stream, or downscaled
            # to RGB first, then an area filter in RGB (scaling in YUV blurs chroma differently)
            frame = frame.reformat(format="rgb24").reformat(width=w, height=h, interpolation="AREA")
        rgb = frame.to_ndarray(format="rgb24")
        for pos in self.slots[i]:
            self.out[pos] = rgb
            self.filled[pos] = True

    def _result(self) -> np.ndarray:
        if self.out is None:
            raise MediaDecodeError(f"{self.label}: no video frame decodes", item=self.item)
        last = 0  # the first pick is frame 0, which was decoded since ``out`` exists
        for pos, done in enumerate(self.filled):
            if done:
                last = pos
            else:
                self.out[pos] = self.out[last]
        return self.out
