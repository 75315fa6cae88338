"""Qwen3-VL: Qwen2-VL's image processor (patch 16, mean/std 0.5 in the released checkpoints) behind
the same adapter, and Qwen3-VL's video processor, whose prompt is one run per temporal patch::

    <|video_pad|>  ──▶  <0.2 seconds><|vision_start|> pad × h·w/4 <|vision_end|> <1.2 seconds><|vision_start|> ...

(``Qwen3VLProcessor.replace_video_token``). The chat template's own wrapper around the video token,
``<|vision_start|><|video_pad|><|vision_end|>``, collapses into the bare token first (``prompt_text``),
since every run carries its own (transformers 5.25, ``get_text_with_replacements``). A timestamp
is the mean time of the patch's frames, ``frame index / fps``, the last frame repeated to fill a patch, as ``_calculate_timestamps`` does.
The timestamps follow from the video's bytes and sampling settings (both in the mm_hash), travel with
the item (``frame_times``; the cache entry keeps them, so a cache hit builds the same prompt), and
each run becomes its own prompt item over its rows of the one encoder output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from encoder_service.preprocess.media.decoded import MediaMetadata, MediaValue
from encoder_service.preprocess.media.limits import MediaLimits
from encoder_service.preprocess.media.video import sample_frame_indices
from encoder_service.preprocess.processors.base import ItemFacts, ProcessedItem
from encoder_service.preprocess.processors.qwen2_vl import Qwen2VLFamily
from encoder_service.types import Modality

if TYPE_CHECKING:
    from transformers import ProcessorMixin

FRAME_TIMES: Final = "frame_times"  # the item-metadata key


def patch_times(indices: list[int], fps: float, temporal_patch: int) -> list[float]:
    """Seconds of each temporal patch: the mean of its first and last frame's time."""
    padded = list(indices) + [indices[-1]] * (-len(indices) % temporal_patch)
    times = [i / fps for i in padded]
    return [(times[i] + times[i + temporal_patch - 1]) / 2 for i in range(0, len(times), temporal_patch)]


class Qwen3VLFamily(Qwen2VLFamily):
    def __init__(self, hf_processor: ProcessorMixin, limits: MediaLimits, *, jpeg_draft: bool = True) -> None:
        super().__init__(hf_processor, limits, jpeg_draft=jpeg_draft)
        tok = self.tokenizer
        self.vision_start_id = int(tok.convert_tokens_to_ids("<|vision_start|>"))
        self.vision_end_id = int(tok.convert_tokens_to_ids("<|vision_end|>"))

    def prompt_text(self, text: str) -> str:
        """The template's wrapper around a video token goes: each run brings its own start and end."""
        video = self.placeholder_tokens["video"]
        return text.replace(f"<|vision_start|>{video}<|vision_end|>", video)

    def process(self, modality: Modality, value: MediaValue) -> ProcessedItem:
        if modality != "video":
            return super().process(modality, value)
        sub = self.hf.video_processor  # frames are sampled already (decode_media, frame_multiple)
        out = sub(videos=[value], return_tensors="pt", do_sample_frames=False)
        tensors = {"pixel_values_videos": out["pixel_values_videos"], "video_grid_thw": out["video_grid_thw"]}
        return self._item(tensors, "video_grid_thw", int(sub.merge_size))

    def item_metadata(self, modality: Modality, media_metadata: MediaMetadata | None) -> ItemFacts:
        if modality != "video":
            return {}
        meta = media_metadata or {}
        indices = sample_frame_indices(int(meta["total_frames"]), int(meta["sampled_frames"]))
        return {FRAME_TIMES: patch_times(indices, float(meta["fps"]), self.frame_multiple)}

    def expand_placeholder(
        self, modality: Modality, token_id: int, num_embeds: int, frame_times: list[float] | None
    ) -> list[int]:
        if modality != "video":
            return [token_id] * num_embeds
        if not frame_times or num_embeds % len(frame_times):
            raise ValueError(f"a Qwen3-VL video of {num_embeds} embeddings needs its frame times")
        per_patch = num_embeds // len(frame_times)
        out: list[int] = []
        for t in frame_times:
            out += self.tokenizer(f"<{t:.1f} seconds>", add_special_tokens=False)["input_ids"]
            out += [self.vision_start_id, *([token_id] * per_patch), self.vision_end_id]
        return out
