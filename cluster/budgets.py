"""Encoder budgets: ``max_num_encoder_input_tokens`` and ``encoder_cache_size``, in embeddings.

Both default from the LLM's ``max_num_batched_tokens`` (E/P/D: the prefill pool's) and are raised to fit the largest item the
preprocessing limits allow, so an admitted item always fits one encoder step and the cache.
"""

from __future__ import annotations

from pathlib import Path

from cluster.config import ModelConfig
from encoder_service.families import largest_item_embeds as family_largest_item
from encoder_service.families import row_units as family_row_units


def largest_item_embeds(model: ModelConfig, model_dir: str | None = None) -> int:
    """The most embeddings one admitted item can become under this model's limits: the family's own
    rule (``encoder_service.families``), from the model directory's configs when given, else the tiny
    generator's defaults; never more than ``max_model_len``."""
    if model_dir is None and model.tiny is None:
        return model.llm.max_model_len  # a path model seen before its files are read: the safe bound
    largest = family_largest_item(model_dir, model.tiny, model.preprocess.media)
    return min(largest, model.llm.max_model_len)


def row_units(model: ModelConfig, model_dir: str | None = None) -> int:
    """LLM-width rows per encoder output row (1 + DeepStack levels for Qwen3-VL): the cache's charge
    per embedding. From the model directory (given, or the config's path when it is on this node),
    else the tiny generator's defaults; 1 when neither can be read."""
    if model_dir is None and model.tiny is None:
        path = Path(model.path or "")
        model_dir = str(path) if (path / "config.json").is_file() else None
        if model_dir is None:
            return 1
    return family_row_units(model_dir, model.tiny if model_dir is None else None)


def encoder_budgets(model: ModelConfig, model_dir: str | None = None) -> tuple[int, int]:
    """(max_num_encoder_input_tokens, encoder_cache_size) for this model. The cache is counted in
    LLM-width rows: an item costs its embeddings times ``row_units``."""
    largest = largest_item_embeds(model, model_dir)
    units = row_units(model, model_dir)
    # the LLM pool the encoder feeds: `both`, or E/P/D's prefill pool (its own engine settings)
    step_tokens = model.llm.for_role(model.llm.roles[0]).max_num_batched_tokens
    compute = max(model.encoder.max_num_encoder_input_tokens or step_tokens, largest)
    default_cache = step_tokens * units
    cache = max(model.encoder.encoder_cache_size or default_cache, largest * units)
    return compute, cache
