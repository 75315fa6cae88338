"""Pure figures of a chaos run (no I/O): each request's fate around one fault, and how fast the
service came back. ``cluster/bench/chaos.py`` drives the load and the kills and feeds these.

    ──── before ────┬── kill ──┬──────────── after ────────────▶ time
                    │          └ first success of a request sent after the kill
                    └ requests open at this instant were "in flight" when it died

A request is ``ok``, ``failed`` (the server answered with an error: a 5xx, an SSE error event), or
``lost`` (no answer within the client's timeout: a hang, which a fault must never cause).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cluster.bench.stats import percentile


@dataclass(frozen=True)
class Sent:
    """One request of the steady load, as the client saw it (times from ``time.monotonic``)."""

    kind: str
    start: float
    end: float
    ok: bool
    ttft_s: float | None = None
    error: str | None = None

    @property
    def lost(self) -> bool:
        return not self.ok and self.error is not None and "timed out" in self.error.lower()


@dataclass(frozen=True)
class FaultReport:
    target: str
    sent: int
    ok: int
    failed: int
    lost: int
    failed_in_flight: int  # of the failed and lost: open when the process died
    ttft_p50_before: float | None
    ttft_p99_before: float | None
    ttft_p50_after: float | None
    ttft_p99_after: float | None
    first_ok_after_s: float | None  # kill -> first success of a request sent after it
    recovered_s: float | None  # kill -> completions back to half the rate before
    errors: tuple[str, ...] = ()


def _pct(values: Sequence[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def recovery_s(
    records: Sequence[Sent], kill_at: float, before_s: float, window_s: float = 2.0, step_s: float = 0.25
) -> float | None:
    """Seconds from the kill until ``window_s`` of completions reach half the rate seen before it."""
    before = [r for r in records if r.ok and kill_at - before_s <= r.end < kill_at]
    if not before:
        return None
    target = 0.5 * len(before) / before_s
    ends = sorted(r.end for r in records if r.ok and r.end >= kill_at)
    if not ends:
        return None
    t = kill_at
    while t + window_s <= ends[-1] + step_s:
        n = sum(1 for e in ends if t <= e < t + window_s)
        if n / window_s >= target:
            return t - kill_at
        t += step_s
    return None


def fault_report(target: str, records: Sequence[Sent], kill_at: float, before_s: float) -> FaultReport:
    failed = [r for r in records if not r.ok and not r.lost]
    lost = [r for r in records if r.lost]
    in_flight = [r for r in failed + lost if r.start <= kill_at <= r.end]
    ttft_before = [r.ttft_s for r in records if r.ok and r.ttft_s is not None and r.end < kill_at]
    ttft_after = [r.ttft_s for r in records if r.ok and r.ttft_s is not None and r.start > kill_at]
    first_ok = min((r.end for r in records if r.ok and r.start > kill_at), default=None)
    errors = tuple(sorted({(r.error or "")[:120] for r in failed + lost}))
    return FaultReport(
        target=target,
        sent=len(records),
        ok=sum(r.ok for r in records),
        failed=len(failed),
        lost=len(lost),
        failed_in_flight=len(in_flight),
        ttft_p50_before=_pct(ttft_before, 50),
        ttft_p99_before=_pct(ttft_before, 99),
        ttft_p50_after=_pct(ttft_after, 50),
        ttft_p99_after=_pct(ttft_after, 99),
        first_ok_after_s=None if first_ok is None else first_ok - kill_at,
        recovered_s=recovery_s(records, kill_at, before_s),
        errors=errors,
    )


@dataclass(frozen=True)
class BurstReport:
    sent: int
    refused: int  # 503 overloaded
    ok: int
    other_failures: int
    refusal_p50_s: float | None
    refusal_p99_s: float | None
    accepted_p50_s: float | None
    e2e_before_s: float | None
    e2e_after_s: float | None


def burst_report(
    burst: Sequence[tuple[int, float]], before: Sequence[float], after: Sequence[float]
) -> BurstReport:
    """``burst``: (HTTP status, seconds) per request; ``before``/``after``: e2e of single requests."""
    refused = [s for status, s in burst if status == 503]
    ok = [s for status, s in burst if status == 200]
    return BurstReport(
        sent=len(burst),
        refused=len(refused),
        ok=len(ok),
        other_failures=len(burst) - len(refused) - len(ok),
        refusal_p50_s=_pct(refused, 50),
        refusal_p99_s=_pct(refused, 99),
        accepted_p50_s=_pct(ok, 50),
        e2e_before_s=_pct(before, 50),
        e2e_after_s=_pct(after, 50),
    )
