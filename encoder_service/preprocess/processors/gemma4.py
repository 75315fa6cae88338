"""Gemma 4 (images and audio): each image is resized keeping its aspect ratio to at most ``max_soft_tokens`` x k^2 patches
(k: the pooling kernel) and becomes one soft token per k x k patches, written into the prompt as HF's
``Gemma4Processor`` writes it::

    template:  ...<|image|>...
    prompt:    ...<|image><|image|> x N<image|>...

``prompt_text`` widens each image marker of the templated text that way (one soft token, which the
preprocessor repeats N times like any placeholder, N from the item's own processing), so the text
around it tokenizes exactly as HF's processor tokenizes it. The item's tensors are its real patches
only (the processor pads every image to ``max_soft_tokens`` x k^2 patches; the padding carries no
information and the tower does not need it) and their (x, y) positions.

Audio: ``<|audio|>`` becomes ``<|audio><|audio|> x N<audio|>``, N the clip's valid log-mel frames after
the tower's two stride-2 convolutions (one soft token per 40 ms), as HF's processor counts them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from encoder_service.preprocess.media.decoded import MediaValue
from encoder_service.preprocess.media.limits import MediaLimits
from encoder_service.preprocess.processors.base import FamilyProcessor, ProcessedItem
from encoder_service.types import Modality

if TYPE_CHECKING:
    from transformers import ProcessorMixin


class Gemma4Family(FamilyProcessor):
    modalities: tuple[Modality, ...] = ("image", "audio")
    placeholder_tokens: ClassVar[dict[Modality, str]] = {"image": "<|image|>", "audio": "<|audio|>"}
    uses_mrope = False

    def __init__(self, hf_processor: ProcessorMixin, limits: MediaLimits) -> None:
        super().__init__(hf_processor)
        tok = hf_processor.tokenizer
        # the checkpoint's own names for them
        self.placeholder_token_ids = {"image": int(tok.image_token_id), "audio": int(tok.audio_token_id)}
        self.limits = limits
        self.widen = {
            str(tok.image_token): f"{tok.boi_token}{tok.image_token}{tok.eoi_token}",
            str(tok.audio_token): f"{tok.boa_token}{tok.audio_token}{tok.eoa_token}",
        }
        image, fe = hf_processor.image_processor, hf_processor.feature_extractor
        self.pooling = int(image.pooling_kernel_size)
        self.sampling_rate = int(fe.sampling_rate)

    def prompt_text(self, text: str) -> str:
        for marker, widened in self.widen.items():
            text = text.replace(marker, widened)
        return text

    def log_kwargs(self, modality: Modality) -> dict[str, object]:
        if modality == "audio":
            return {"sampling_rate": self.sampling_rate}
        image = self.hf.image_processor
        return {"max_soft_tokens": image.max_soft_tokens, "patch_size": image.patch_size}

    def process(self, modality: Modality, value: MediaValue) -> ProcessedItem:
        if modality == "audio":
            out = self.hf.feature_extractor([value], return_tensors="pt")
            mask = out["input_features_mask"]
            tensors = {"input_features": out["input_features"], "input_features_mask": mask}
            return ProcessedItem(tensors, int(mask[0, ::2][::2].sum()), None)
        out = self.hf.image_processor(images=[value], return_tensors="pt")
        n = int(out["num_soft_tokens_per_image"][0])
        real = n * self.pooling**2  # the padding patches come last
        tensors = {
            "pixel_values": out["pixel_values"][0, :real],
            "image_position_ids": out["image_position_ids"][0, :real],
        }
        return ProcessedItem(tensors, n, None)
