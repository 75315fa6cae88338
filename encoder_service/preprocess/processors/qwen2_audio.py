"""Qwen2-Audio: Whisper log-mel features (padded to the 30 s window); no M-RoPE."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from encoder_service.preprocess.media.decoded import MediaValue
from encoder_service.preprocess.processors.base import FamilyProcessor, ProcessedItem
from encoder_service.types import Modality

if TYPE_CHECKING:
    from transformers import ProcessorMixin


def audio_num_embeds(num_feature_frames: int) -> int:
    """Whisper's conv stack (stride 2) then Qwen2-Audio's avg-pool (stride 2) over the valid frames."""
    after_conv = (num_feature_frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


class Qwen2AudioFamily(FamilyProcessor):
    modalities = ("audio",)
    placeholder_tokens: ClassVar[dict[Modality, str]] = {"audio": "<|AUDIO|>"}
    uses_mrope = False

    def __init__(self, hf_processor: ProcessorMixin) -> None:
        super().__init__(hf_processor)
        fe = hf_processor.feature_extractor
        self.sampling_rate = int(fe.sampling_rate)

    def log_kwargs(self, modality: Modality) -> dict[str, object]:
        fe = self.hf.feature_extractor
        return {
            "sampling_rate": self.sampling_rate,
            "feature_size": fe.feature_size,
            "n_samples": fe.n_samples,
        }

    def process(self, modality: Modality, value: MediaValue) -> ProcessedItem:
        out = self.hf.feature_extractor(
            [value],
            sampling_rate=self.sampling_rate,
            return_attention_mask=True,
            padding="max_length",
            return_tensors="pt",
        )
        mask = out["attention_mask"]
        tensors = {"input_features": out["input_features"], "feature_attention_mask": mask}
        return ProcessedItem(tensors, audio_num_embeds(int(mask.sum())), None)
