"""Model-family adapters over HF processors (placeholders, hash kwargs, per-item processing).

Which adapter a model gets is the family registry's answer (``encoder_service/families.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from encoder_service.families import encoder_family
from encoder_service.preprocess.media.limits import MediaLimits
from encoder_service.preprocess.processors.base import FamilyProcessor, ProcessedItem
from encoder_service.preprocess.processors.qwen2_5_vl import Qwen25VLFamily
from encoder_service.preprocess.processors.qwen2_audio import Qwen2AudioFamily, audio_num_embeds
from encoder_service.preprocess.processors.qwen2_vl import Qwen2VLFamily

if TYPE_CHECKING:
    from transformers import ProcessorMixin

__all__ = [
    "FamilyProcessor",
    "ProcessedItem",
    "Qwen2AudioFamily",
    "Qwen2VLFamily",
    "Qwen25VLFamily",
    "audio_num_embeds",
    "load_family_processor",
    "qwen2_audio_processor",
]


def qwen2_audio_processor(hf_processor: ProcessorMixin, limits: MediaLimits) -> FamilyProcessor:
    """The registry's (hf_processor, limits) factory for Qwen2-Audio (its adapter takes no limits)."""
    return Qwen2AudioFamily(hf_processor)


def load_family_processor(model_dir: str | Path, limits: MediaLimits) -> FamilyProcessor:
    """``AutoProcessor.from_pretrained`` (fast variants) wrapped in the family's adapter."""
    from transformers import AutoProcessor

    model_type = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
    family = encoder_family(model_type, str(model_dir))
    hf: ProcessorMixin = AutoProcessor.from_pretrained(str(model_dir), use_fast=True)
    adapter: FamilyProcessor = family.processor_factory()(hf, limits)
    return adapter
