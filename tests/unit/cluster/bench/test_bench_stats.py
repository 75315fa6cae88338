"""The benchmark's pure statistics and tables, against values computed by hand (no Ray, no server)."""

from __future__ import annotations

import pytest

from cluster.bench.client import flatten_stats, server_root
from cluster.bench.stats import (
    Comparison,
    Distribution,
    RequestResult,
    ScenarioStats,
    comparison_table,
    counter_deltas,
    latency_table,
    markdown_table,
    percentile,
    ratio,
    ratio_table,
    summarize,
)
from cluster.bench.workload import WorkloadConfig, build_scenarios


def test_percentile_interpolates_linearly_between_order_statistics() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 50) == pytest.approx(2.5)  # rank 1.5: halfway between 2 and 3
    assert percentile(xs, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(xs, 99) == pytest.approx(3.97)  # rank 2.97
    assert percentile(xs, 100) == 4.0
    assert percentile([10.0, 20.0, 30.0, 40.0, 50.0], 90) == pytest.approx(46.0)  # rank 3.6
    assert percentile([7.0], 99) == 7.0


def test_percentile_refuses_nothing_and_bad_q() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="within"):
        percentile([1.0], 101)


def test_tpot_is_time_after_the_first_token_per_later_token() -> None:
    r = RequestResult("text", ok=True, e2e_s=1.0, ttft_s=0.25, output_tokens=16)
    assert r.tpot_s == pytest.approx(0.75 / 15)
    assert RequestResult("text", ok=True, e2e_s=1.0, ttft_s=0.25, output_tokens=1).tpot_s is None
    assert RequestResult("text", ok=False, e2e_s=1.0, error="boom").tpot_s is None


def _results() -> list[RequestResult]:
    return [
        RequestResult(
            "text", True, e2e_s=0.5, ttft_s=0.1, output_tokens=5, prompt_tokens=20, cached_tokens=16
        ),
        RequestResult(
            "text", True, e2e_s=0.9, ttft_s=0.3, output_tokens=5, prompt_tokens=20, cached_tokens=0
        ),
        RequestResult(
            "image", True, e2e_s=0.7, ttft_s=0.2, output_tokens=3, prompt_tokens=40, cached_tokens=4
        ),
        RequestResult("image", False, e2e_s=0.05, error="503"),
    ]


def test_summarize_counts_only_successful_requests() -> None:
    s = summarize("row", _results(), duration_s=2.0, server={"encoder_cache_hits": 3})
    assert (s.completed, s.failed) == (3, 1)
    assert s.ttft == Distribution(
        mean=pytest.approx(0.2), p50=0.2, p90=pytest.approx(0.28), p99=pytest.approx(0.298)
    )
    assert s.e2e is not None and s.e2e.p50 == 0.7
    # TPOTs: (0.5-0.1)/4 = 0.1, (0.9-0.3)/4 = 0.15, (0.7-0.2)/2 = 0.25 -> median 0.15
    assert s.tpot is not None and s.tpot.p50 == pytest.approx(0.15)
    assert s.output_tokens == 13 and s.request_throughput == 1.5 and s.output_throughput == 6.5
    assert s.prefix_hit_rate == pytest.approx(20 / 80)


def test_summarize_of_only_failures_has_no_distributions() -> None:
    s = summarize("row", [RequestResult("text", False, e2e_s=0.1)], duration_s=1.0)
    assert s.ttft is None and s.tpot is None and s.e2e is None and s.prefix_hit_rate is None
    assert s.request_throughput == 0.0


def test_counter_deltas_and_ratio() -> None:
    assert counter_deltas({"a": 1, "b": 5}, {"a": 4, "b": 5, "c": 9}) == {"a": 3, "b": 0}
    assert counter_deltas(None, {"a": 1}) is None
    assert ratio(3.0, 4.0) == 0.75
    assert ratio(3.0, 0.0) is None and ratio(None, 1.0) is None


def test_markdown_table_aligns_first_column_left() -> None:
    assert markdown_table(["a", "b"], [["x", "1"], ["y", "2"]]) == (
        "| a | b |\n| :--- | ---: |\n| x | 1 |\n| y | 2 |"
    )


def _two_rows() -> list[ScenarioStats]:
    base = summarize("text", [RequestResult("text", True, e2e_s=1.0, ttft_s=0.1, output_tokens=11)], 2.0)
    slow = summarize("img", [RequestResult("image", True, e2e_s=1.5, ttft_s=0.4, output_tokens=11)], 4.0)
    return [base, slow]


def test_ratio_table_divides_each_row_by_the_baseline() -> None:
    lines = ratio_table(_two_rows(), "text").splitlines()
    assert lines[0].startswith("| scenario | TTFT p50 ×text | TTFT p90 ×text | TPOT p50 ×text |")
    assert lines[2] == "| text | 1.00 | 1.00 | 1.00 | 1.00 | 1.00 | 1.00 |"
    # TTFT 0.4/0.1; TPOT (1.1/10)/(0.9/10); E2E 1.5/1.0; req/s (1/4)/(1/2); tok/s (11/4)/(11/2)
    assert lines[3] == "| img | 4.00 | 4.00 | 1.22 | 1.50 | 0.50 | 0.50 |"
    with pytest.raises(ValueError, match="baseline"):
        ratio_table(_two_rows(), "missing")


def test_comparison_table_and_missing_rows() -> None:
    claims = [Comparison("images are slower", "img", "text"), Comparison("absent", "nope", "text")]
    lines = comparison_table(_two_rows(), claims).splitlines()
    assert lines[2] == "| images are slower | img | text | 4.00 | 4.00 | 1.50 |"
    assert lines[3] == "| absent | nope | text | - | - | - |"


def test_latency_table_in_milliseconds_with_server_counters() -> None:
    rows = _two_rows()
    rows[0] = summarize(
        "text", [RequestResult("text", True, 1.0, 0.1, 11, 32, 16)], 2.0, {"encoder_items_dispatched": 2}
    )
    lines = latency_table(rows).splitlines()
    assert lines[2] == (
        "| text | 1 | 0 | 100.0 | 100.0 | 100.0 | 90.0 | 90.0 | 90.0 | 1000.0 | 1000.0 | 1000.0 "
        "| 11 | 0.50 | 5.5 | 50% | - | - | 2 |"
    )
    assert lines[3].endswith("| 11 | 0.25 | 2.8 | - | - | - | - |")


def test_server_stats_are_summed_over_models() -> None:
    body = {
        "m1": {"encoder_cache": {"hits": 2, "misses": 1, "evictions": 0}, "encoder_items_dispatched": 1},
        "m2": {
            "encoder_cache": {"hits": 1, "misses": 4, "evictions": 2},
            "near_cache": {"entries": 1, "hits": 5, "misses": 2},  # the ingress's: hits the index never saw
            "encoder_items_dispatched": 3,
        },
    }
    assert flatten_stats(body) == {
        "encoder_cache_hits": 8,
        "encoder_cache_misses": 5,
        "encoder_cache_evictions": 2,
        "encoder_items_dispatched": 4,
    }
    assert server_root("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"


def test_scenarios_reuse_the_cold_images_and_send_uuids_alone_later() -> None:
    cfg = WorkloadConfig(num_requests=2, image_width=56, image_height=56, audio_seconds=0.5, run_id=7)
    by_name = {s.name: s for s in build_scenarios(cfg)}
    assert list(by_name) == ["text", "images-cold", "images-warm", "images-uuid", "mix"]
    assert by_name["images-warm"].requests == by_name["images-cold"].requests
    uuid_parts = [r.content[0] for r in by_name["images-uuid"].requests]
    cold_parts = [r.content[0] for r in by_name["images-cold"].requests]
    assert [p["uuid"] for p in uuid_parts] == [p["uuid"] for p in cold_parts]
    assert all("image_url" not in p for p in uuid_parts) and all("image_url" in p for p in cold_parts)
    assert [r.kind for r in by_name["mix"].requests] == ["text", "image", "audio"] * 2
    assert {p["uuid"] for p in cold_parts}.isdisjoint(
        r.content[0].get("uuid") for r in by_name["mix"].requests
    )


def _pools(enc: tuple[str, float, float], llms: dict[str, tuple[float, float]]) -> dict[str, object]:
    """A ``GET /stats?pools=true`` answer of one model, in the shape the ingress gives it."""
    rid, wall, cpu = enc
    encoder = {"queued_items": 0, "steps": 3, "step_wall_s": wall, "step_cpu_s": cpu, "replica_id": rid}
    return {
        "tiny": {
            "encoder_cache": {"hits": 0},
            "pools": {
                "preparing_replica": encoder,
                "llm_replicas": {
                    r: {"num_running": 0, "step_wall_s": w, "step_cpu_s": c, "replica_id": r}
                    for r, (w, c) in llms.items()
                },
            },
        }
    }


def test_step_cpu_shares_between_two_stats_answers() -> None:
    from cluster.bench.stats import step_cpu_shares

    before = _pools(("e1", 10.0, 4.0), {"a": (5.0, 3.0), "b": (1.0, 1.0)})
    after = _pools(("e1", 20.0, 7.0), {"a": (9.0, 5.0), "b": (7.0, 4.0), "new": (2.0, 2.0)})
    # encoder: 3 of 10 s; LLM: (2 + 3) of (4 + 6) s, the replica only in ``after`` left out
    assert step_cpu_shares(before, after) == {"encoder": 0.3, "llm": 0.5}
    # Serve picked another encoder replica for the second answer: no encoder share, not a wrong one
    other = _pools(("e2", 30.0, 9.0), {"a": (9.0, 5.0)})
    assert step_cpu_shares(before, other) == {"llm": 0.5}
    # vLLM, or a server without the pools' counters: nothing
    assert step_cpu_shares({}, {"detail": "Not Found"}) == {}
