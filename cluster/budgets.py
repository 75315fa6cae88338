"""Encoder budgets: ``max_num_encoder_input_tokens`` and ``encoder_cache_size``, in embeddings.

Both default from the LLM's ``max_num_batched_tokens`` and are raised to fit the largest item the
preprocessing limits allow, so an admitted item always fits one encoder step and the cache.
"""

from __future__ import annotations

from cluster.config import ModelConfig
from encoder_service.families import largest_item_embeds as family_largest_item


def largest_item_embeds(model: ModelConfig, model_dir: str | None = None) -> int:
    """The most embeddings one admitted item can become under this model's limits: the family's own
    rule (``encoder_service.families``), from the model directory's configs when given, else the tiny
    generator's defaults; never more than ``max_model_len``."""
    if model_dir is None and model.tiny is None:
        return model.llm.max_model_len  # a path model seen before its files are read: the safe bound
    largest = family_largest_item(model_dir, model.tiny, model.preprocess.media)
    return min(largest, model.llm.max_model_len)


def encoder_budgets(model: ModelConfig, model_dir: str | None = None) -> tuple[int, int]:
    """(max_num_encoder_input_tokens, encoder_cache_size) for this model."""
    largest = largest_item_embeds(model, model_dir)
    compute = max(model.encoder.max_num_encoder_input_tokens or model.llm.max_num_batched_tokens, largest)
    cache = max(model.encoder.encoder_cache_size or model.llm.max_num_batched_tokens, largest)
    return compute, cache
