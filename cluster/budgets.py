"""Encoder budgets: ``max_num_encoder_input_tokens`` and ``encoder_cache_size``, in embeddings.

Both default from the LLM's ``max_num_batched_tokens`` and are raised to fit the largest item the
preprocessing limits allow, so an admitted item always fits one encoder step and the cache.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from cluster.config import ModelConfig


def largest_item_embeds(model: ModelConfig, model_dir: str | None = None) -> int:
    """The most embeddings one admitted item can become under this model's limits."""
    limits = model.preprocess.media
    family: str | None = model.tiny
    max_pixels_cfg = 28 * 28 * 1024  # the tiny models' processor cap
    if model_dir is not None:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        family = {"qwen2_vl": "qwen2-vl", "qwen2_audio": "qwen2-audio"}.get(cfg.get("model_type"), family)
        proc_path = Path(model_dir) / "processor_config.json"
        if proc_path.exists():
            size = json.loads(proc_path.read_text()).get("image_processor", {}).get("size", {})
            max_pixels_cfg = int(size.get("longest_edge", max_pixels_cfg))
    if family == "qwen2-audio":
        return 750  # Whisper pads to 30 s: 3000 mel frames -> 1500 after the conv -> 750 after pooling
    per_image = math.ceil(min(max_pixels_cfg, limits.max_pixels) / (28 * 28))
    per_frame = math.ceil(min(max_pixels_cfg, limits.max_video_pixels_per_frame) / (28 * 28))
    per_video = math.ceil(limits.max_video_frames / 2) * per_frame
    return min(max(per_image, per_video), model.llm.max_model_len)


def encoder_budgets(model: ModelConfig, model_dir: str | None = None) -> tuple[int, int]:
    """(max_num_encoder_input_tokens, encoder_cache_size) for this model."""
    largest = largest_item_embeds(model, model_dir)
    compute = max(model.encoder.max_num_encoder_input_tokens or model.llm.max_num_batched_tokens, largest)
    cache = max(model.encoder.encoder_cache_size or model.llm.max_num_batched_tokens, largest)
    return compute, cache
