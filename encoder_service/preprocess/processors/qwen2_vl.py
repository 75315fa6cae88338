"""Qwen2-VL: images via ``Qwen2VLImageProcessor``, videos via ``Qwen2VLVideoProcessor``; M-RoPE.

Images take ``Qwen2VLImageTransform`` (the same floats as HF's torchvision processor, with fewer
copies) whenever the loaded processor's settings are the ones it replicates; otherwise HF's own call.

JPEG draft (``jpeg_draft``, on by default): when ``smart_resize`` shrinks a JPEG to half its size or
less, libjpeg decodes it at 1/2, 1/4 or 1/8 scale (never below the target) and the transform resizes
from there to the target computed from the ORIGINAL size, so the grid and the placeholder count are
HF's. The pixels are not bit-identical: the DCT-domain downscale filters like a box where HF's bicubic
antialias is wider; measured on photo-like JPEGs at quality 75-90 the difference is about 1 uint8
level on average (p99 ≤ 4, max ≤ 10), under what the JPEG quantisation already put there
(tests/unit/encoder_service/preprocess/processors/test_image_transform.py holds it to mean ≤ 1.5, p99 ≤ 6, max ≤ 16). The policy is
part of the image mm_hash, so embeddings of one decode are never served for the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from PIL import Image

from encoder_service.preprocess.hit_path_facts import DRAFT_POLICY
from encoder_service.preprocess.media.decoded import MediaValue
from encoder_service.preprocess.media.image import DecodedImage
from encoder_service.preprocess.media.limits import MediaLimits
from encoder_service.preprocess.processors.base import FamilyProcessor, ProcessedItem
from encoder_service.preprocess.processors.qwen2_vl_image import Qwen2VLImageTransform, smart_target_size
from encoder_service.types import Modality

if TYPE_CHECKING:
    import torch
    from transformers import ProcessorMixin
    from transformers.image_processing_utils import BaseImageProcessor


class Qwen2VLFamily(FamilyProcessor):
    modalities: tuple[Modality, ...] = ("image", "video")
    placeholder_tokens: ClassVar[dict[Modality, str]] = {"image": "<|image_pad|>", "video": "<|video_pad|>"}
    uses_mrope = True

    def __init__(self, hf_processor: ProcessorMixin, limits: MediaLimits, *, jpeg_draft: bool = True) -> None:
        super().__init__(hf_processor)
        self.limits = limits
        self.frame_multiple = int(hf_processor.video_processor.temporal_patch_size)
        self.image_transform = Qwen2VLImageTransform.from_hf(hf_processor.image_processor)
        # A JPEG is decoded at reduced scale only where the transform takes the original size apart.
        self.jpeg_draft = jpeg_draft and self.image_transform is not None

    def _sub(self, modality: Modality) -> BaseImageProcessor:  # the video processor derives from it too
        return self.hf.image_processor if modality == "image" else self.hf.video_processor

    def decode_kwargs(self, modality: Modality) -> dict[str, object]:
        """A JPEG draft decode goes into the image's mm_hash (``DRAFT_POLICY``)."""
        return {"mmserve_decode": DRAFT_POLICY} if modality == "image" and self.jpeg_draft else {}

    def log_kwargs(self, modality: Modality) -> dict[str, object]:
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

    def check_image_size(self, width: int, height: int) -> None:
        if max(width, height) > 200 * min(width, height):
            raise ValueError(
                f"aspect ratio {max(width, height) / min(width, height):.1f} ({width}x{height}) is over "
                "200, the most the Qwen2-VL image processor accepts"
            )

    def image_decode_size(self, width: int, height: int) -> tuple[int, int] | None:
        if not (self.jpeg_draft and self.image_transform is not None):
            return None
        proc = self.hf.image_processor
        return smart_target_size(
            width,
            height,
            factor=int(proc.patch_size) * int(proc.merge_size),
            min_pixels=int(proc.size.shortest_edge),
            max_pixels=int(proc.size.longest_edge),
        )

    def process_image(self, image: DecodedImage) -> ProcessedItem:
        if self.image_transform is None:
            return super().process_image(image)
        tensors = self.image_transform(image.image, (image.width, image.height))
        return self._item(tensors, "image_grid_thw", merge=self.image_transform.merge_size)

    def process(self, modality: Modality, value: MediaValue) -> ProcessedItem:
        sub = self._sub(modality)
        if modality == "image":
            if self.image_transform is not None:
                assert isinstance(value, Image.Image)  # images decode to a PIL image (decode_image)
                return self._item(self.image_transform(value), "image_grid_thw", int(sub.merge_size))
            out = sub(images=[value], return_tensors="pt")
            tensors = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
            return self._item(tensors, "image_grid_thw", int(sub.merge_size))
        out = sub(videos=[value], return_tensors="pt")
        tensors = {"pixel_values_videos": out["pixel_values_videos"], "video_grid_thw": out["video_grid_thw"]}
        return self._item(tensors, "video_grid_thw", int(sub.merge_size))

    @staticmethod
    def _item(tensors: dict[str, torch.Tensor], grid_key: str, merge: int) -> ProcessedItem:
        t, h, w = (int(x) for x in tensors[grid_key][0].tolist())
        return ProcessedItem(tensors, t * h * w // merge**2, (t, h, w))
