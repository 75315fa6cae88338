"""What decoding one media item gives: its value, and the facts found on the way."""

from __future__ import annotations

from typing import TypedDict

import numpy as np
from PIL import Image

# RGB ``PIL.Image`` (image), ``uint8 [T, H, W, 3]`` sampled frames (video), ``float32 [samples]`` (audio)
MediaValue = Image.Image | np.ndarray


class MediaMetadata(TypedDict, total=False):
    """Facts about one decoded item: its log line's, and (video) what the LLM's positions need."""

    source: str  # where the bytes came from (``FetchedMedia.source``)
    num_bytes: int
    format: str | None  # the image format, container or codec the decoder named
    width: int  # image, video
    height: int
    decoded_size: list[int]  # an image decoded at reduced scale: [width, height] as decoded
    seconds: float  # video, audio
    total_frames: int  # video: frames in the clip
    sampled_frames: int  # video: frames kept
    fps: float  # video: the stream's frame rate
    orig_sampling_rate: int  # audio: the source's rate, before resampling
