"""Model-family adapters over HF processors (placeholders, hash kwargs, per-item processing)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from encoder_service.media.limits import MediaLimits
from encoder_service.processors.base import FamilyProcessor, ProcessedItem
from encoder_service.processors.qwen2_5_vl import Qwen25VLFamily
from encoder_service.processors.qwen2_audio import Qwen2AudioFamily, audio_num_embeds
from encoder_service.processors.qwen2_vl import Qwen2VLFamily

__all__ = [
    "FamilyProcessor",
    "ProcessedItem",
    "Qwen2AudioFamily",
    "Qwen2VLFamily",
    "Qwen25VLFamily",
    "audio_num_embeds",
    "load_family_processor",
]


def load_family_processor(model_dir: str | Path, limits: MediaLimits) -> FamilyProcessor:
    """``AutoProcessor.from_pretrained`` (fast variants) wrapped in the family's adapter."""
    from transformers import AutoProcessor

    model_type = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
    hf: Any = AutoProcessor.from_pretrained(str(model_dir), use_fast=True)
    if model_type == "qwen2_vl":
        return Qwen2VLFamily(hf, limits)
    if model_type == "qwen2_5_vl":
        return Qwen25VLFamily(hf, limits)
    if model_type == "qwen2_audio":
        return Qwen2AudioFamily(hf)
    raise ValueError(
        f"unsupported model_type {model_type!r}: mmserve knows qwen2_vl, qwen2_5_vl and qwen2_audio"
    )
