from __future__ import annotations

import itertools
import random

import pytest

from encoder_service.encode.batching import EncoderBudgetError, plan_encoder_batches, split_items_across_ranks


def test_plan_respects_budget_and_order() -> None:
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.randint(1, 50) for _ in range(rng.randint(0, 30))]
        budget = rng.randint(50, 120)
        steps = plan_encoder_batches(sizes, budget)
        assert [i for step in steps for i in step] == list(range(len(sizes)))
        assert all(step and sum(sizes[i] for i in step) <= budget for step in steps)
        # greedy: the next step's first item would not have fitted into the previous step
        for a, b in itertools.pairwise(steps):
            assert sum(sizes[i] for i in a) + sizes[b[0]] > budget


def test_plan_hand_computed() -> None:
    assert plan_encoder_batches([4, 4, 3, 10, 1], 10) == [[0, 1], [2], [3], [4]]
    assert plan_encoder_batches([], 10) == []


def test_plan_refuses_oversize_item() -> None:
    with pytest.raises(EncoderBudgetError, match="item 1 needs 11"):
        plan_encoder_batches([3, 11, 2], 10)
    with pytest.raises(ValueError):
        plan_encoder_batches([1], 0)


def test_split_hand_computed() -> None:
    # largest first onto the least-loaded rank: 9->r0, 7->r1, 5->r1 (7<9), 4->r0 (9<12), 1->r1 (12<13)
    assert split_items_across_ranks([5, 9, 1, 7, 4], 2) == [[1, 4], [0, 2, 3]]
    assert split_items_across_ranks([3], 3) == [[0], [], []]


def test_split_is_a_partition_and_balanced() -> None:
    rng = random.Random(1)
    for _ in range(200):
        sizes = [rng.randint(1, 100) for _ in range(rng.randint(1, 40))]
        ranks = rng.randint(1, 4)
        shares = split_items_across_ranks(sizes, ranks)
        assert sorted(i for s in shares for i in s) == list(range(len(sizes)))
        assert all(s == sorted(s) for s in shares)
        loads = [sum(sizes[i] for i in s) for s in shares]
        # LPT bound: no rank exceeds the lightest by more than the largest item
        assert max(loads) - min(loads) <= max(sizes)
        assert shares == split_items_across_ranks(sizes, ranks)  # deterministic
