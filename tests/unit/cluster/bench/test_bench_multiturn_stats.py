"""The multi-turn benchmark's per-turn aggregation (pure, no server)."""

from __future__ import annotations

import math

import pytest

from cluster.bench.multiturn_stats import (
    TurnResult,
    all_turns_hit_rate,
    goal,
    later_turns_hit_rate,
    policy_table,
    render_table,
    turn_rows,
)


def _results(ttfts: dict[int, list[float]], prompt: int, cached: dict[int, int]) -> list[TurnResult]:
    return [
        TurnResult(conv, turn, ok=True, ttft_s=t, prompt_tokens=prompt * turn, cached_tokens=cached[turn])
        for turn, ts in ttfts.items()
        for conv, t in enumerate(ts)
    ]


def test_turn_rows_sum_tokens_and_skip_failures() -> None:
    results = [
        TurnResult(0, 1, ok=True, ttft_s=0.030, prompt_tokens=80, cached_tokens=0),
        TurnResult(1, 1, ok=True, ttft_s=0.010, prompt_tokens=80, cached_tokens=16),
        TurnResult(2, 1, ok=True, ttft_s=0.020, prompt_tokens=80, cached_tokens=16),
        TurnResult(0, 2, ok=True, ttft_s=0.005, prompt_tokens=120, cached_tokens=80),
        TurnResult(1, 2, ok=False, error="boom"),
        TurnResult(2, 2, ok=False, prompt_tokens=120, cached_tokens=120, error="no content streamed"),
    ]
    one, two = turn_rows(results)
    assert (one.turn, one.completed, one.failed) == (1, 3, 0)
    assert one.ttft_mean_s == pytest.approx(0.020)
    assert one.ttft_p50_s == pytest.approx(0.020)
    assert one.hit_rate == pytest.approx(32 / 240)
    assert (two.turn, two.completed, two.failed) == (2, 1, 2)
    assert (two.prompt_tokens, two.cached_tokens) == (120, 80)  # the failed requests' tokens do not count
    assert later_turns_hit_rate([one, two]) == pytest.approx(80 / 120)


def test_goal_ratios_hybrid_over_attention() -> None:
    ttfts = {1: [0.04, 0.04], 2: [0.02, 0.02], 3: [0.03, 0.03]}
    hybrid = turn_rows(_results(ttfts, 100, {1: 0, 2: 54, 3: 180}))
    attention = turn_rows(
        _results({t: [v / 2 for v in vs] for t, vs in ttfts.items()}, 100, {1: 16, 2: 60, 3: 200})
    )
    g = goal(hybrid, attention)
    assert g["turn3_ttft_ratio"] == pytest.approx(2.0)
    assert g["turn3_ttft_p50_ratio"] == pytest.approx(2.0)
    assert g["hit_rate_ratio"] == pytest.approx((54 + 180) / (60 + 200))  # turns 2+ only: turn 1 left out
    table = render_table({"h": hybrid, "a": attention}, "h", "a")
    assert "| 3 | 30.0 / 30.0, 0.60 | 15.0 / 15.0, 0.67 | 2.00 | 0.90 |" in table
    assert table.splitlines()[-1].startswith("| 2+ | hit 0.47 | hit 0.52 |")


def test_goal_without_the_turn_is_nan() -> None:
    rows = turn_rows([TurnResult(0, 1, ok=True, ttft_s=0.01, prompt_tokens=10)])
    g = goal(rows, rows)
    assert all(math.isnan(v) for v in g.values()) and len(g) == 3


def test_policy_table_one_row_per_snapshot_interval() -> None:
    ttfts = {1: [0.04, 0.04], 2: [0.02, 0.02], 3: [0.03, 0.03]}
    prompt_ends = turn_rows(_results(ttfts, 100, {1: 0, 2: 54, 3: 180}))
    every_block = turn_rows(_results(ttfts, 100, {1: 32, 2: 54, 3: 180}))
    attention = turn_rows(
        _results({t: [v / 2 for v in vs] for t, vs in ttfts.items()}, 100, {1: 16, 2: 60, 3: 200})
    )
    assert all_turns_hit_rate(every_block) == pytest.approx(2 * (32 + 54 + 180) / 1200)  # 2 conversations
    table = policy_table({"h0": prompt_ends, "h1": every_block, "a": attention}, {"h0": 0, "h1": 1}, "a")
    lines = table.splitlines()
    assert (
        lines[0]
        == "| snapshots | hit all turns | hit turns 2+ | turn 1 TTFT | turn 2 TTFT | turn 3 TTFT | turn 3 x a |"
    )
    assert lines[2] == "| prompt ends only | 0.39 | 0.47 | 40.0 | 20.0 | 30.0 | 2.00 |"
    assert lines[3].startswith("| every 1 blocks | 0.44 | 0.47 |")
    assert len(lines) == 4
