"""Qwen2-VL's image transform, bit-for-bit what HF's torchvision-backend ``Qwen2VLImageProcessor`` computes,
without its detours.

HF: PIL ─np.array─▶ HWC ─contiguous─▶ CHW ─resize (uint8, bicubic AA)─▶ float ─(x-m)/s─▶ patchify (copy)
here: PIL's own memory seen as CHW (no copy) ─resize (same kernel)─▶ float ─(x-m)/s─▶ patchify

The same torch ops run on the same values (resize on uint8, ``sub_`` then ``div_`` by the fused constants),
so every float is identical; what goes is the channel-first copy, the validation and grouping layers,
and the second pass over the output that HF's reshape makes. ``target_size`` gives the resize target
from the ORIGINAL size, so a JPEG decoded at reduced scale (draft) lands on the same grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from encoder_service.preprocess.processors.pil_view import rgb_view

if TYPE_CHECKING:
    from PIL import Image
    from transformers.image_processing_utils import BaseImageProcessor


@dataclass(frozen=True)
class Qwen2VLImageTransform:
    min_pixels: int
    max_pixels: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    mean: torch.Tensor  # [3] float32, already divided by the rescale factor (HF's fused form)
    std: torch.Tensor

    @classmethod
    def from_hf(cls, proc: BaseImageProcessor) -> Qwen2VLImageTransform | None:
        """The transform for ``proc``, or None when its settings are not the ones replicated here."""
        try:
            from transformers.image_processing_backends import TorchvisionBackend
            from transformers.image_utils import PILImageResampling
        except ImportError:  # pragma: no cover - another transformers layout: use HF's own call
            return None
        size = proc.size
        supported = (
            isinstance(proc, TorchvisionBackend)
            and proc.do_resize
            and proc.do_rescale
            and proc.do_normalize
            and proc.do_convert_rgb
            and proc.resample == PILImageResampling.BICUBIC
            and getattr(proc, "device", None) in (None, "cpu")
            and bool(size.shortest_edge and size.longest_edge)
        )
        if not supported:
            return None
        scale = 1.0 / proc.rescale_factor
        return cls(
            min_pixels=int(size.shortest_edge),
            max_pixels=int(size.longest_edge),
            patch_size=int(proc.patch_size),
            merge_size=int(proc.merge_size),
            temporal_patch_size=int(proc.temporal_patch_size),
            mean=torch.tensor(proc.image_mean) * scale,
            std=torch.tensor(proc.image_std) * scale,
        )

    def target_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after HF's ``smart_resize``; ValueError for an aspect ratio over 200."""
        return smart_target_size(
            width,
            height,
            factor=self.patch_size * self.merge_size,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
        )

    def __call__(
        self, rgb: Image.Image, source_size: tuple[int, int] | None = None
    ) -> dict[str, torch.Tensor]:
        """``pixel_values`` [patches, 3*T*P*P] and ``image_grid_thw`` [1, 3] for one RGB ``PIL.Image``.

        ``source_size`` is the size the image had before a reduced-scale decode (default: its own)."""
        x, keepalive = rgb_view(rgb)  # [1, 3 or 4, H, W] uint8 over the image's own memory
        tw, th = self.target_size(*(source_size or rgb.size))
        if (th, tw) != tuple(x.shape[-2:]):
            # Channels are independent: resizing Pillow's padding channel too costs nothing extra.
            x = F.interpolate(x, size=[th, tw], mode="bicubic", align_corners=False, antialias=True)
        # Channel-first float whatever the uint8 strides (without a resize they are PIL's pixel-interleaved
        # ones, and every op below would crawl along 3-element rows). A mixed-dtype ``torch.sub`` would
        # fold the cast in but runs 5x slower.
        x = x[0, :3].to(torch.float32, memory_format=torch.contiguous_format)
        del keepalive  # the uint8 view is not read past this point
        x.sub_(self.mean.view(-1, 1, 1)).div_(self.std.view(-1, 1, 1))
        return {"pixel_values": self._patchify(x), "image_grid_thw": self._grid(th, tw)}

    def _grid(self, th: int, tw: int) -> torch.Tensor:
        return torch.tensor([[1, th // self.patch_size, tw // self.patch_size]], dtype=torch.long)

    def _patchify(self, x: torch.Tensor) -> torch.Tensor:
        """[3, H, W] → [gh*gw, 3*T*P*P] in HF's order (merge windows, then rows, cols), one copy."""
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        c, h, w = x.shape
        gh, gw = h // p, w // p
        src = x.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        out = torch.empty((gh // m, gw // m, m, m, c, t, p, p), dtype=x.dtype)
        out.copy_(src.unsqueeze(5).expand(-1, -1, -1, -1, -1, t, -1, -1))
        return out.view(gh * gw, c * t * p * p)


def smart_target_size(
    width: int, height: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """HF's ``smart_resize`` (multiples of ``factor``, pixels within bounds, aspect kept) as (width, height)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    h, w = smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    return int(w), int(h)
