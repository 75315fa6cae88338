"""Encoder/LLM pool scaling decisions, checked against hand-computed replica counts."""

from __future__ import annotations

import pytest

from cluster.autoscaling import (
    EncoderTargets,
    Hysteresis,
    LLMReplicaLoad,
    LLMTargets,
    ScalingBounds,
    desired_encoder_replicas,
    desired_llm_replicas,
    desired_replicas,
    llm_pressure,
)

B = ScalingBounds(1, 10)


@pytest.mark.parametrize(
    ("running", "load", "expected"),
    [
        (2, 20.0, 2),  # exactly at target (10/replica): hold
        (2, 21.9, 2),  # ratio 1.095 < 1.1: hold
        (2, 23.0, 3),  # ratio 1.15: grow to ceil(23/10)
        (2, 95.0, 10),  # ceil(9.5) = 10
        (2, 500.0, 10),  # clamped to max
        (4, 30.0, 4),  # ratio 0.75 >= 0.7: hold
        (4, 25.0, 3),  # ratio 0.625: shrink to ceil(2.5)
        (4, 0.0, 1),  # idle: clamped to min
        (1, 5.0, 1),  # one replica with some load never drops under it
    ],
)
def test_desired_replicas_deadband(running: int, load: float, expected: int) -> None:
    assert desired_replicas(running, load, 10.0, B) == expected


def test_scale_to_zero_only_when_idle_and_min_is_zero() -> None:
    zero_ok = ScalingBounds(0, 4)
    assert desired_replicas(1, 0.0, 10.0, zero_ok) == 0
    assert desired_replicas(1, 0.5, 10.0, zero_ok) == 1
    # cold start: nothing running, some load -> enough replicas for it
    assert desired_replicas(0, 25.0, 10.0, zero_ok) == 3
    assert desired_replicas(0, 0.0, 10.0, zero_ok) == 0


def test_hold_keeps_the_last_decision_inside_the_deadband() -> None:
    # 3 replicas asked for, 2 running so far, load right at target for 2: keep asking for 3
    assert desired_replicas(2, 20.0, 10.0, B, hold=3) == 3


def test_a_scale_up_still_starting_is_not_undone_by_the_load_on_the_running_replicas() -> None:
    # 2 asked for, 1 running: the backlog on the one drops under the deadband (1 would do) while the
    # second starts; asking for 1 would cancel it. Keep 2 until it runs; then the same load shrinks.
    assert desired_replicas(1, 4.0, 10.0, B, hold=2) == 2
    assert desired_replicas(2, 4.0, 10.0, B, hold=2) == 1
    # a growing load still grows past what is starting
    assert desired_replicas(1, 45.0, 10.0, B, hold=2) == 5
    t = LLMTargets(target_ongoing_requests=4.0)
    idle = {"a": LLMReplicaLoad(num_running=1.0)}
    assert desired_llm_replicas(1, idle, 0, t, B, hold=3) == 3
    assert (
        desired_llm_replicas(3, {**idle, "b": LLMReplicaLoad(), "c": LLMReplicaLoad()}, 0, t, B, hold=3) == 1
    )


def test_decision_is_stable_once_taken() -> None:
    """After a move, the same load must not move the pool again (no flapping)."""
    h = Hysteresis()
    for running in range(1, 11):
        for tenths in range(0, 1200, 7):
            load = tenths / 10
            n = desired_replicas(running, load, 10.0, B, h)
            assert desired_replicas(n, load, 10.0, B, h) == n, (running, load, n)


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        ScalingBounds(3, 2)
    with pytest.raises(ValueError):
        ScalingBounds(-1, 2)
    with pytest.raises(ValueError):
        Hysteresis(upscale_above=0.9)
    with pytest.raises(ValueError):
        Hysteresis(downscale_below=0)
    with pytest.raises(ValueError):
        desired_replicas(1, 1.0, 0.0, B)
    with pytest.raises(ValueError):
        LLMTargets(target_kv_usage=1.5)
    with pytest.raises(ValueError):
        EncoderTargets(target_queued_embeddings_per_replica=0)


def test_encoder_scales_on_queued_embeddings_and_handle_queue() -> None:
    t = EncoderTargets(target_queued_embeddings_per_replica=1000, embeddings_per_handle_queued_request=100)
    # 2 replicas with 1500 + 1700 queued = 3200 -> ratio 1.6 -> ceil(3.2) = 4
    assert desired_encoder_replicas(2, {"a": 1500, "b": 1700}, 0, t, B) == 4
    # same backlog plus 8 requests queued at handles (8 * 100 = 800) -> 4000 -> 4
    assert desired_encoder_replicas(2, {"a": 1500, "b": 1700}, 8, t, B) == 4
    # plus 9 -> 4100 -> 5
    assert desired_encoder_replicas(2, {"a": 1500, "b": 1700}, 9, t, B) == 5
    # drained: down to min
    assert desired_encoder_replicas(5, {"a": 0, "b": 0}, 0, t, B) == 1


def test_llm_pressure_takes_the_tighter_resource() -> None:
    t = LLMTargets(target_kv_usage=0.8, target_ongoing_requests=10)
    assert llm_pressure(LLMReplicaLoad(kv_usage=0.4, num_running=2), t) == pytest.approx(0.5)
    assert llm_pressure(LLMReplicaLoad(kv_usage=0.1, num_running=12, num_waiting=3), t) == pytest.approx(1.5)


def test_llm_scales_on_kv_usage_even_with_few_requests() -> None:
    t = LLMTargets(target_kv_usage=0.8, target_ongoing_requests=16)
    full = {i: LLMReplicaLoad(kv_usage=0.96, num_running=2) for i in range(2)}
    # pressure 1.2 on each of 2 replicas -> 2.4 -> 3
    assert desired_llm_replicas(2, full, 0, t, B) == 3
    # 3 running, only 2 have reported: the third counts at the mean, 3.6 -> 4
    assert desired_llm_replicas(3, full, 0, t, B) == 4
    # idle KV but 4 requests queued at handles -> 0.25 x ... small; 2 replicas at 0.1 -> 0.2 + 0.25 -> 1
    idle = {i: LLMReplicaLoad(kv_usage=0.08) for i in range(2)}
    assert desired_llm_replicas(2, idle, 4, t, B) == 1
    # no reports at all: keep what was decided
    assert desired_llm_replicas(2, {}, 0, t, B, hold=3) == 3


def test_prefill_pool_scales_on_prompt_tokens_to_compute() -> None:
    """E/P/D's prefill pool: the backlog of prompt tokens over the pool against the target per replica."""
    from cluster.autoscaling import PrefillTargets, desired_prefill_replicas

    targets = PrefillTargets(
        target_queued_prompt_tokens_per_replica=4096, prompt_tokens_per_handle_queued_request=1024
    )
    bounds = ScalingBounds(1, 8)
    # 2 replicas, 20,000 tokens queued + 4 requests at handles (4,096): 24,096 / 4096 -> 6 replicas
    assert desired_prefill_replicas(2, {"a": 12_000.0, "b": 8_000.0}, 4, targets, bounds) == 6
    # inside the deadband (ratio 0.9): hold
    assert desired_prefill_replicas(2, {"a": 3_700.0, "b": 3_700.0}, 0, targets, bounds) == 2
    # idle: down to the minimum
    assert desired_prefill_replicas(3, {"a": 0.0, "b": 0.0, "c": 0.0}, 0, targets, bounds) == 1


@pytest.mark.parametrize(
    ("backlog", "running", "ttft", "hold", "expected"),
    [
        (2, 2, {"a": 900.0, "b": 1_300.0}, None, 3),  # the slowest over 1.1 x 1,000 ms: one more
        (5, 2, {"a": 1_300.0}, None, 5),  # the backlog already asks for more: its answer
        (2, 2, {"a": 1_300.0}, 4, 4),  # a scale-up still starting: none added
        (7, 7, {"a": 5_000.0}, None, 8),  # capped by the bounds
        (1, 3, {"a": 800.0, "b": 100.0}, None, 3),  # near the target (0.8): the backlog may not shrink it
        (1, 3, {"a": 1_050.0}, 2, 2),  # ... nor below what the last decision kept
        (1, 3, {"a": 600.0, "b": 0.0}, None, 1),  # both under theirs: the backlog's shrink stands
        (1, 3, {}, None, 1),  # no report: the backlog's
    ],
)
def test_prefill_pool_ttft_over_target_grows_it_and_under_lets_it_shrink(
    backlog: int, running: int, ttft: dict[str, float], hold: int | None, expected: int
) -> None:
    from cluster.autoscaling import with_ttft

    assert with_ttft(backlog, running, ttft, 1_000.0, ScalingBounds(1, 8), hold=hold) == expected


def test_recent_ttft_is_the_windows_p90() -> None:
    from llm_service.outputs import RequestOutput, RequestTiming
    from llm_service.recent_ttft import RecentTTFT

    now = [0.0]
    ttft = RecentTTFT(window_s=10.0, clock=lambda: now[0])
    assert ttft.p90_ms() == 0.0  # nothing yet

    def out(queue: float, prefill: float, tokens: tuple[int, ...] = (5,)) -> RequestOutput:
        return RequestOutput(
            "r", list(tokens), None, True, "handoff", 8, 0, timing=RequestTiming(queue, prefill, 0.0)
        )

    ttft.observe([out(0.5, 0.5)])  # 1,000 ms, soon out of the window
    now[0] = 5.0
    ttft.observe([out(0.01 * i, 0.09) for i in range(1, 11)])  # 100, 110, ..., 190 ms
    ttft.observe([RequestOutput("x", [], None, True, "error", 8, 0, error="e")])  # no first token: none
    assert ttft.p90_ms() == pytest.approx(190.0)  # 11 samples: the 10th (nearest rank), not the 1,000
    now[0] = 10.5
    assert ttft.p90_ms() == pytest.approx(180.0)  # the 1,000 ms one left the window: 9th of 10
    now[0] = 16.0
    assert ttft.p90_ms() == 0.0
