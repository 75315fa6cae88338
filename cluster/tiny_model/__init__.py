"""Deterministic tiny random-weight models (Qwen2-VL, Qwen2-Audio) written as real HF model directories."""

from __future__ import annotations

from cluster.tiny_model.families import FAMILIES, PRESETS, ModelSize, make_tiny_model

__all__ = ["FAMILIES", "PRESETS", "ModelSize", "make_tiny_model"]
