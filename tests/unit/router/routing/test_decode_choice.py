"""Which decode replica takes an E/P/D request: room for its blocks first, then load + KV use."""

from __future__ import annotations

import random

from router.routing.decode_choice import KV_WEIGHT, rank_decode


def test_equal_load_goes_to_the_freer_kv() -> None:
    order = rank_decode({"a": 2.0, "b": 2.0}, {"a": 0.9, "b": 0.1}, {"a": 10, "b": 90})
    assert order == ["b", "a"]


def test_a_nearly_full_replica_loses_to_a_busier_one_with_room() -> None:
    # a: 1 request, 95 % KV; b: 3 requests, 10 % KV -> 1 + 4 * 0.95 = 4.8 against 3 + 0.4 = 3.4
    assert KV_WEIGHT == 4.0
    assert rank_decode({"a": 1.0, "b": 3.0}, {"a": 0.95, "b": 0.1}, {}) == ["b", "a"]
    # but far busier loses again: 7 + 0.4 = 7.4 against 4.8
    assert rank_decode({"a": 1.0, "b": 7.0}, {"a": 0.95, "b": 0.1}, {}) == ["a", "b"]


def test_a_replica_without_room_for_the_request_goes_last() -> None:
    order = rank_decode({"a": 0.0, "b": 5.0}, {"a": 0.0, "b": 0.5}, {"a": 3, "b": 40}, need_blocks=10)
    assert order == ["b", "a"]


def test_unreported_replicas_count_as_empty_and_ties_are_random() -> None:
    seen = {tuple(rank_decode({"a": 0.0, "b": 0.0}, {}, {}, rng=random.Random(s))) for s in range(20)}
    assert seen == {("a", "b"), ("b", "a")}
