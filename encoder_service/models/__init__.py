"""Encoder towers by model family, loaded from a local HF model directory's safetensors."""

from __future__ import annotations

from pathlib import Path

import torch

from encoder_service.models.common import EncoderModel
from encoder_service.models.qwen2_5_vl_vision import Qwen25VLVisionEncoder
from encoder_service.models.qwen2_audio_encoder import Qwen2AudioEncoder
from encoder_service.models.qwen2_vl_vision import Qwen2VLVisionEncoder
from encoder_service.models.weights import CheckpointReader, read_config
from encoder_service.tp.parallel import TPContext

# config.json model_type -> tower class
ENCODERS: dict[str, type[EncoderModel]] = {
    "qwen2_vl": Qwen2VLVisionEncoder,
    "qwen2_5_vl": Qwen25VLVisionEncoder,
    "qwen2_audio": Qwen2AudioEncoder,
}


def load_encoder_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device, tp: TPContext | None = None
) -> EncoderModel:
    """Build the family's tower(s) with this rank's shard of the weights, in eval mode on ``device``."""
    config = read_config(model_dir)
    model_type = config.get("model_type")
    if model_type not in ENCODERS:
        raise ValueError(
            f"{model_dir}: model_type {model_type!r} has no encoder; supported: {', '.join(ENCODERS)}"
        )
    model = ENCODERS[model_type](config, tp or TPContext())
    model.load_weights(CheckpointReader(model_dir, dtype))
    return model.to(device=device, dtype=dtype).eval()


__all__ = ["ENCODERS", "EncoderModel", "load_encoder_model"]
