"""The encoder cache counts LLM-width rows: a Qwen3-VL row carries its DeepStack levels beside the main
embedding, so it is charged 1 + levels; the budgets and the shard sizing scale with it."""

from __future__ import annotations

from cluster.budgets import encoder_budgets, largest_item_embeds, row_units
from cluster.cache_shards import cache_index_args
from cluster.config import ModelConfig
from cluster.tiny_model.families import ModelSize
from cluster.tiny_model.qwen3_vl import deepstack_indexes
from encoder_service.cache.encoder_cache import CacheReply, EncoderCacheBooks
from encoder_service.families import TINY_QWEN3_VL_DEEPSTACK_LEVELS, deepstack_row_units
from encoder_service.types import EmbeddingMeta


def test_a_row_with_deepstack_levels_is_charged_for_each_and_crosses_the_wire() -> None:
    books = EncoderCacheBooks(20)
    meta = EmbeddingMeta("a" * 64, "image", 4, 3 * 8, "float32", (1, 4, 4), units=3)
    assert EmbeddingMeta.from_msgpack(meta.to_msgpack()) == meta
    assert books.lookup_or_reserve("r", "a" * 64, 0.0) == CacheReply.COMPUTE
    books.commit("a" * 64, meta)
    assert books.used == 12  # 4 rows x (main + 2 levels)
    plain = EmbeddingMeta("b" * 64, "image", 10, 8, "float32", (1, 4, 4))
    assert EmbeddingMeta.from_msgpack(plain.to_msgpack()).units == 1
    assert books.lookup_or_reserve("r", "b" * 64, 0.0) == CacheReply.COMPUTE
    books.commit("b" * 64, plain)  # 12 + 10 > 20: the first entry is evicted
    assert books.used == 10 and books.take_freed() == ["a" * 64]


def test_the_tiny_default_is_what_the_generator_writes_and_real_configs_are_read() -> None:
    assert len(deepstack_indexes(ModelSize().vision_depth)) == TINY_QWEN3_VL_DEEPSTACK_LEVELS
    assert deepstack_row_units({"vision_config": {"deepstack_visual_indexes": [8, 16, 24]}}) == 4
    assert deepstack_row_units({}) == 4  # transformers' default


def test_budgets_and_every_shard_fit_the_largest_item_in_rows_times_units() -> None:
    q3 = ModelConfig.model_validate({"name": "q3", "tiny": "qwen3-vl"})
    q2 = ModelConfig.model_validate({"name": "q2", "tiny": "qwen2-vl"})
    units = row_units(q3)
    assert units == 1 + TINY_QWEN3_VL_DEEPSTACK_LEVELS and row_units(q2) == 1
    compute, cache = encoder_budgets(q3)
    largest = largest_item_embeds(q3)
    assert compute >= largest and cache >= largest * units
    _, _, capacity, largest_charge = cache_index_args(q3)
    assert largest_charge == largest * units and capacity == cache
