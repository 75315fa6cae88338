"""Gemma 3: every image is resized to the tower's square size and becomes ``image_seq_length`` soft
tokens, written into the prompt as HF's ``Gemma3Processor`` writes them::

    template:  ...<start_of_image>...
    prompt:    ...\\n\\n<start_of_image><image_soft_token> x N<end_of_image>\\n\\n...

``prompt_text`` widens each ``<start_of_image>`` of the templated text that way (one soft token, which
the preprocessor repeats N times like any placeholder), so the text around it tokenizes exactly as
HF's processor tokenizes it. Pan-and-scan (extra crops per image) is not supported: a processor
config that enables it is refused at load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from encoder_service.preprocess.media.decoded import MediaValue
from encoder_service.preprocess.media.limits import MediaLimits
from encoder_service.preprocess.processors.base import FamilyProcessor, ProcessedItem
from encoder_service.types import Modality

if TYPE_CHECKING:
    from transformers import ProcessorMixin


class Gemma3Family(FamilyProcessor):
    modalities: tuple[Modality, ...] = ("image",)
    placeholder_tokens: ClassVar[dict[Modality, str]] = {"image": "<image_soft_token>"}
    uses_mrope = False

    def __init__(self, hf_processor: ProcessorMixin, limits: MediaLimits) -> None:
        super().__init__(hf_processor)
        tok = hf_processor.tokenizer
        self.placeholder_token_ids = {"image": int(tok.image_token_id)}  # the checkpoint's own name for it
        image = hf_processor.image_processor
        if getattr(image, "do_pan_and_scan", False):
            raise ValueError(
                "Gemma 3 pan-and-scan (do_pan_and_scan) is not supported; turn it off in the processor config"
            )
        self.limits = limits
        self.num_tokens = int(hf_processor.image_seq_length)
        self.boi_token = str(tok.boi_token)
        self.image_text = f"\n\n{tok.boi_token}{tok.image_token}{tok.eoi_token}\n\n"

    def prompt_text(self, text: str) -> str:
        return text.replace(self.boi_token, self.image_text)

    def log_kwargs(self, modality: Modality) -> dict[str, object]:
        size = self.hf.image_processor.size
        return {"size": [size.height, size.width], "image_seq_length": self.num_tokens}

    def process(self, modality: Modality, value: MediaValue) -> ProcessedItem:
        out = self.hf.image_processor(images=[value], return_tensors="pt")
        return ProcessedItem({"pixel_values": out["pixel_values"]}, self.num_tokens, None)
