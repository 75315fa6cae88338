"""Deterministic tiny random-weight models written as real HF model directories, one ``TinyRecipe`` per family."""

from __future__ import annotations

from cluster.tiny_model.families import (
    FAMILIES,
    PRESETS,
    TINY_RECIPES,
    ModelSize,
    TinyRecipe,
    make_tiny_model,
    tiny_recipe,
)

__all__ = ["FAMILIES", "PRESETS", "TINY_RECIPES", "ModelSize", "TinyRecipe", "make_tiny_model", "tiny_recipe"]
