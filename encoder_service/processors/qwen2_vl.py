"""Qwen2-VL: images via ``Qwen2VLImageProcessor``, videos via ``Qwen2VLVideoProcessor``; M-RoPE."""

from __future__ import annotations

from typing import Any, ClassVar

from encoder_service.media.limits import MediaLimits
from encoder_service.processors.base import FamilyProcessor, ProcessedItem, processor_config
from encoder_service.types import Modality


class Qwen2VLFamily(FamilyProcessor):
    modalities = ("image", "video")
    placeholder_tokens: ClassVar[dict[Modality, str]] = {"image": "<|image_pad|>", "video": "<|video_pad|>"}
    uses_mrope = True

    def __init__(self, hf_processor: Any, limits: MediaLimits) -> None:
        super().__init__(hf_processor)
        self.limits = limits
        self.frame_multiple = int(hf_processor.video_processor.temporal_patch_size)
        self._hash_kwargs = {
            "image": processor_config(hf_processor.image_processor),
            "video": {
                **processor_config(hf_processor.video_processor),
                "sample_fps": limits.video_fps,
                "sample_num_frames": limits.video_num_frames,
                "frame_multiple": self.frame_multiple,
            },
        }

    def _sub(self, modality: Modality) -> Any:
        return self.hf.image_processor if modality == "image" else self.hf.video_processor

    def hash_kwargs(self, modality: Modality) -> dict[str, Any]:
        return self._hash_kwargs[modality]

    def log_kwargs(self, modality: Modality) -> dict[str, Any]:
        sub = self._sub(modality)
        size = sub.size
        out = {
            "min_pixels": getattr(size, "shortest_edge", None),
            "max_pixels": getattr(size, "longest_edge", None),
            "patch_size": sub.patch_size,
            "merge_size": sub.merge_size,
            "temporal_patch_size": sub.temporal_patch_size,
        }
        if modality == "video":
            out.update(fps=self.limits.video_fps, num_frames=self.limits.video_num_frames)
        return out

    def process(self, modality: Modality, value: Any) -> ProcessedItem:
        sub = self._sub(modality)
        if modality == "image":
            out = sub(images=[value], return_tensors="pt")
            pixels, grid = out["pixel_values"], out["image_grid_thw"]
            tensors = {"pixel_values": pixels, "image_grid_thw": grid}
        else:
            out = sub(videos=[value], return_tensors="pt")
            pixels, grid = out["pixel_values_videos"], out["video_grid_thw"]
            tensors = {"pixel_values_videos": pixels, "video_grid_thw": grid}
        t, h, w = (int(x) for x in grid[0].tolist())
        return ProcessedItem(tensors, t * h * w // int(sub.merge_size) ** 2, (t, h, w))
