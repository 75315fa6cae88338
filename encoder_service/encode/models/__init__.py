"""Encoder towers by model family, loaded from a local HF model directory's safetensors.

Which tower a model gets is the family registry's answer (``encoder_service/families.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from encoder_service.encode.models.common import EncoderModel
from encoder_service.encode.models.weights import CheckpointReader, read_config
from encoder_service.encode.tp.parallel import TPContext
from encoder_service.families import encoder_family


def load_encoder_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device, tp: TPContext | None = None
) -> EncoderModel:
    """Build the family's tower(s) with this rank's shard of the weights, in eval mode on ``device``."""
    config = read_config(model_dir)
    tower: type[EncoderModel] = encoder_family(config.get("model_type"), str(model_dir)).tower_class()
    model = tower(config, tp or TPContext())
    model.load_weights(CheckpointReader(model_dir, dtype))
    return model.to(device=device, dtype=dtype).eval()


__all__ = ["EncoderModel", "load_encoder_model"]
