"""Qwen2.5-VL: Qwen2-VL's image and video processors (the released checkpoints ship the same classes),
plus, per video, the seconds one temporal patch spans (``second_per_grid_ts``), which the LLM needs
for its absolute-time M-RoPE positions.

``second_per_grid_ts = temporal_patch_size / sampled_fps``, as ``Qwen2_5_VLProcessor`` computes it
from ``VideoMetadata.sampled_fps`` (frames kept / frames in the clip * native fps, i.e. frames kept
per second of clip). It follows from the video's bytes and the sampling settings, which the mm_hash
covers, so one mm_hash always has one value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from encoder_service.preprocess.media.decoded import MediaMetadata
from encoder_service.preprocess.media.limits import MediaLimits
from encoder_service.preprocess.processors.base import ItemFacts
from encoder_service.preprocess.processors.qwen2_vl import Qwen2VLFamily
from encoder_service.types import Modality

if TYPE_CHECKING:
    from transformers import ProcessorMixin

SECOND_PER_GRID_TS: Final = "second_per_grid_ts"  # the item-metadata key (HF's name for the per-video value)


class Qwen25VLFamily(Qwen2VLFamily):
    def __init__(self, hf_processor: ProcessorMixin, limits: MediaLimits, *, jpeg_draft: bool = True) -> None:
        super().__init__(hf_processor, limits, jpeg_draft=jpeg_draft)
        self.temporal_patch_size = int(hf_processor.video_processor.temporal_patch_size)

    def sampled_fps(self, media_metadata: MediaMetadata | None) -> float:
        """Frames kept per second of clip; without the decode's facts, the rate sampling aims at."""
        meta = media_metadata or {}
        frames, seconds = meta.get("sampled_frames"), meta.get("seconds")
        if frames and seconds and float(seconds) > 0:
            return float(frames) / float(seconds)
        if self.limits.video_num_frames is not None:
            raise ValueError(
                "video_num_frames is set: the sampled fps depends on the clip's length, "
                "which this video's metadata does not give (seconds, sampled_frames)"
            )
        return float(self.limits.video_fps)

    def second_per_grid_ts(self, media_metadata: MediaMetadata | None) -> float:
        return self.temporal_patch_size / self.sampled_fps(media_metadata)

    def item_metadata(self, modality: Modality, media_metadata: MediaMetadata | None) -> ItemFacts:
        """What the LLM needs beyond the grid to place this item's positions (goes into the item's
        metadata, and from there to ``MultiModalInput.second_per_grid_ts``)."""
        if modality != "video":
            return {}
        return {SECOND_PER_GRID_TS: self.second_per_grid_ts(media_metadata)}
