"""Which decode replica takes an E/P/D request: never one that refused it, then room for everything
the import needs (blocks, window blocks, a state slot), then load + KV use."""

from __future__ import annotations

import random

from router.routing.decode_choice import KV_WEIGHT, ImportNeed, rank_decode


def test_equal_load_goes_to_the_freer_kv() -> None:
    order = rank_decode({"a": 2.0, "b": 2.0}, {"a": 0.9, "b": 0.1}, {})
    assert order == ["b", "a"]


def test_a_nearly_full_replica_loses_to_a_busier_one_with_room() -> None:
    # a: 1 request, 95 % KV; b: 3 requests, 10 % KV -> 1 + 4 * 0.95 = 4.8 against 3 + 0.4 = 3.4
    assert KV_WEIGHT == 4.0
    assert rank_decode({"a": 1.0, "b": 3.0}, {"a": 0.95, "b": 0.1}, {}) == ["b", "a"]
    # but far busier loses again: 7 + 0.4 = 7.4 against 4.8
    assert rank_decode({"a": 1.0, "b": 7.0}, {"a": 0.95, "b": 0.1}, {}) == ["a", "b"]


def test_a_replica_without_room_for_the_blocks_goes_last() -> None:
    reports = {"a": {"num_free_blocks": 3}, "b": {"num_free_blocks": 40}}
    order = rank_decode({"a": 0.0, "b": 5.0}, {"a": 0.0, "b": 0.5}, reports, ImportNeed(blocks=10))
    assert order == ["b", "a"]


def test_a_replica_out_of_state_slots_or_window_blocks_goes_last() -> None:
    """Qwen3.5's decode replica with free blocks but no state slot, Gemma's with free blocks but too
    few window blocks: each would refuse the import, so the busier replica with room wins."""
    load, usage = {"a": 0.0, "b": 5.0}, {"a": 0.0, "b": 0.5}
    hybrid = {
        "a": {"num_free_blocks": 90, "num_free_state_slots": 0},
        "b": {"num_free_blocks": 40, "num_free_state_slots": 2},
    }
    assert rank_decode(load, usage, hybrid, ImportNeed(blocks=10, state_slots=1)) == ["b", "a"]
    window = {
        "a": {"num_free_blocks": 90, "num_free_window_blocks": 2},
        "b": {"num_free_blocks": 40, "num_free_window_blocks": 8},
    }
    assert rank_decode(load, usage, window, ImportNeed(blocks=10, window_blocks=3)) == ["b", "a"]
    # a model without those resources reports none of them: nothing short
    assert rank_decode(load, usage, {"a": {"num_free_blocks": 90}}, ImportNeed(10, 3, 1)) == ["a", "b"]


def test_a_replica_that_refused_the_import_goes_after_every_other() -> None:
    reports = {"a": {"num_free_blocks": 90}, "b": {"num_free_blocks": 3}}
    order = rank_decode({"a": 0.0, "b": 5.0}, {}, reports, ImportNeed(blocks=10), refused=["a"])
    assert order == ["b", "a"]  # its report was stale: b, even short on paper, is asked first


def test_unreported_replicas_count_as_empty_and_ties_are_random() -> None:
    seen = {tuple(rank_decode({"a": 0.0, "b": 0.0}, {}, {}, rng=random.Random(s))) for s in range(20)}
    assert seen == {("a", "b"), ("b", "a")}
