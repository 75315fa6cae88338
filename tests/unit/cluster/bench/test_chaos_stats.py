"""cluster/bench/chaos_stats.py: a fault's figures from hand-built request records."""

from __future__ import annotations

from cluster.bench.chaos_stats import Sent, burst_report, fault_report, recovery_s


def _steady(t0: float, t1: float, every: float = 0.25) -> list[Sent]:
    out, t = [], t0
    while t < t1:
        out.append(Sent("text", t - 0.2, t, True, ttft_s=0.05))
        t += every
    return out


def test_fault_report_counts_fates_and_in_flight_failures() -> None:
    kill = 10.0
    records = _steady(0.0, kill) + _steady(13.0, 20.0)  # 3 s with no completion after the kill
    records += [
        Sent("image", 9.5, 10.4, False, error="APIError: llm_replica_lost"),  # open at the kill
        Sent("text", 11.0, 11.2, False, error="APIStatusError: 503 replica_lost"),  # sent after it
        Sent("audio", 9.9, 70.0, False, error="APITimeoutError: Request timed out."),  # a hang
    ]
    r = fault_report("llm", records, kill, before_s=10.0)
    assert (r.failed, r.lost, r.failed_in_flight) == (2, 1, 2)
    assert r.ok == len(records) - 3 and r.sent == len(records)
    assert r.first_ok_after_s is not None and abs(r.first_ok_after_s - 3.0) < 1e-9
    assert r.recovered_s is not None and 2.0 <= r.recovered_s <= 3.0  # the 2 s window reaches 13 s
    assert r.ttft_p50_before == r.ttft_p50_after == 0.05


def test_no_recovery_when_completions_never_come_back() -> None:
    assert recovery_s(_steady(0.0, 10.0), kill_at=10.0, before_s=10.0) is None


def test_burst_report_splits_refusals_from_served() -> None:
    b = burst_report([(503, 0.01), (503, 0.03), (200, 1.5), (0, 60.0)], before=[1.0], after=[1.2])
    assert (b.sent, b.refused, b.ok, b.other_failures) == (4, 2, 1, 1)
    assert b.refusal_p50_s is not None and abs(b.refusal_p50_s - 0.02) < 1e-9
    assert (b.accepted_p50_s, b.e2e_before_s, b.e2e_after_s) == (1.5, 1.0, 1.2)
