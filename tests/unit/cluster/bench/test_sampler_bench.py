"""cluster/bench/sampler.py's reading: percentiles, the p10 ratio and its window range on hand-built
step times; the cases' turns; the engine's schema long enough for every step."""

from __future__ import annotations

from cluster.bench.sampler import DIGITS_SCHEMA, digits_schema, interleave, percentile, summarize, table


def test_percentile_is_the_nearest_rank() -> None:
    xs = [float(x) for x in range(10, 0, -1)]  # 10 .. 1, unsorted on purpose
    assert percentile(xs, 0.0) == 1.0
    assert percentile(xs, 0.1) == 2.0  # rank round(0.9) = 1 of 0..9
    assert percentile(xs, 0.5) == 5.0  # rank round(4.5) = 4
    assert percentile(xs, 1.0) == 10.0


def test_the_ratio_is_of_the_p10s_and_the_windows_span_the_per_window_medians() -> None:
    greedy = [[2.0, 2.0]] * 10
    case = [[3.0, 3.0]] * 5 + [[5.0, 5.0]] * 5  # a slow second half: p10 3.0, windows 1.5 and 2.5
    s = summarize(case, greedy, windows=10)
    assert s.p10 == 3.0 and s.p90 == 5.0
    assert s.ratio == 1.5
    assert s.block_ratios == (1.5, 2.5)


def test_cases_take_turns_block_by_block() -> None:
    order: list[str] = []
    cases = {name: (lambda name=name: order.append(name)) for name in ("a", "b")}
    got = interleave(cases, steps=2, blocks=3, warmup=1)
    assert order == ["a", "b"] + ["a", "a", "b", "b"] * 3
    assert [len(b) for b in got["a"]] == [2, 2, 2] and len(got["b"]) == 3


def test_the_table_has_a_row_per_case_and_tree_with_each_rounds_ratio() -> None:
    r1 = {"32/engine/all greedy": [[2.0]] * 10, "32/engine/mixed": [[3.0]] * 10}
    r2 = {"32/engine/all greedy": [[2.0]] * 10, "32/engine/mixed": [[2.4]] * 10}
    lines = table({"base": [r1], "now": [r1, r2]})
    assert len(lines) == 2 + 4
    mixed_now = next(line for line in lines if "| mixed | now |" in line)
    assert "| 1.50 1.20 |" in mixed_now and "| 1.20 |" in mixed_now  # pooled p10: 2.4 / 2.0


def test_the_engine_schema_is_the_digits_schema_at_a_length() -> None:
    s = digits_schema(300)
    digits = s["properties"]["digits"]
    assert digits["minItems"] == digits["maxItems"] == 300
    assert DIGITS_SCHEMA["properties"]["digits"]["maxItems"] == 40  # the serving benchmark's is untouched
    assert digits["items"] == DIGITS_SCHEMA["properties"]["digits"]["items"]
