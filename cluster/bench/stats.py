"""Pure statistics of the serving benchmark: per-request records, percentiles, ratio tables (no I/O).

Definitions follow ``vllm bench serve``: TTFT is the time from sending the request to the first
streamed chunk that carries a choice; TPOT is ``(e2e - ttft) / (output_tokens - 1)``, the mean time
per output token after the first; percentiles interpolate linearly between order statistics (numpy's
default ``method="linear"``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestResult:
    """One request as the client saw it; times in seconds."""

    kind: str  # "text" | "image" | "audio"
    ok: bool
    e2e_s: float
    ttft_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    itls_s: tuple[float, ...] = ()  # gaps between the streamed chunks that carried text

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Distribution:
    mean: float
    p50: float
    p90: float
    p99: float


@dataclass(frozen=True)
class ScenarioStats:
    """One row of the tables: a scenario, or one kind of request inside a mixed scenario."""

    name: str
    completed: int
    failed: int
    duration_s: float
    ttft: Distribution | None
    tpot: Distribution | None
    e2e: Distribution | None
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    request_throughput: float  # completed requests per second of the scenario's wall time
    output_throughput: float  # output tokens per second of the scenario's wall time
    server: dict[str, int] | None = None  # deltas of the server's /stats counters, when it has them

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, like ``numpy.percentile``."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    xs = sorted(values)
    rank = (len(xs) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def distribution(values: Sequence[float]) -> Distribution | None:
    if not values:
        return None
    return Distribution(
        mean=sum(values) / len(values),
        p50=percentile(values, 50),
        p90=percentile(values, 90),
        p99=percentile(values, 99),
    )


def summarize(
    name: str, results: Sequence[RequestResult], duration_s: float, server: dict[str, int] | None = None
) -> ScenarioStats:
    """Aggregate one scenario's requests; failed requests count only in ``failed``."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return ScenarioStats(
        name=name,
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        ttft=distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=distribution([t for r in ok if (t := r.tpot_s) is not None]),
        e2e=distribution([r.e2e_s for r in ok]),
        output_tokens=out_tokens,
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        cached_tokens=sum(r.cached_tokens for r in ok),
        request_throughput=len(ok) / duration_s if duration_s > 0 else 0.0,
        output_throughput=out_tokens / duration_s if duration_s > 0 else 0.0,
        server=server,
    )


def counter_deltas(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int] | None:
    """``after - before`` per counter both have; None when either side is unknown."""
    if before is None or after is None:
        return None
    return {k: after[k] - before[k] for k in after if k in before}


def step_cpu_shares(before: Mapping[str, object], after: Mapping[str, object]) -> dict[str, float]:
    """Per pool ("encoder", "llm"), the share of its step threads' wall time they ran between two
    ``GET /stats?pools=true`` answers (mmcore/step_clock.py): CPU over wall, summed over every
    model's replicas that are in both answers (the encoder replica is the one Serve picked for
    each, so a pool of several may give none). A pool without steps in between is left out."""
    sums: dict[str, list[float]] = {}

    def add(pool: str, b: object, a: object) -> None:
        if not (isinstance(b, Mapping) and isinstance(a, Mapping)) or "step_wall_s" not in a:
            return
        if (
            "step_wall_s" not in b
            or a.get("replica_id") is None
            or b.get("replica_id") != a.get("replica_id")
        ):
            return
        wall, cpu = a["step_wall_s"] - b["step_wall_s"], a["step_cpu_s"] - b["step_cpu_s"]
        if wall > 0:
            acc = sums.setdefault(pool, [0.0, 0.0])
            acc[0] += cpu
            acc[1] += wall

    for model, now in after.items():
        then = before.get(model)
        if not (isinstance(now, Mapping) and isinstance(then, Mapping)):
            continue
        pools_now, pools_then = now.get("pools"), then.get("pools")
        if not (isinstance(pools_now, Mapping) and isinstance(pools_then, Mapping)):
            continue
        add("encoder", pools_then.get("preparing_replica"), pools_now.get("preparing_replica"))
        llm_now, llm_then = pools_now.get("llm_replicas"), pools_then.get("llm_replicas")
        if isinstance(llm_now, Mapping) and isinstance(llm_then, Mapping):
            for rid, stats in llm_now.items():
                add("llm", llm_then.get(rid), stats)
    return {pool: round(cpu / wall, 3) for pool, (cpu, wall) in sums.items()}


def ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None or reference == 0:
        return None
    return value / reference


# -- tables ------------------------------------------------------------------------------------------

Metric = Callable[[ScenarioStats], float | None]

RATIO_METRICS: dict[str, Metric] = {
    "TTFT p50": lambda s: s.ttft.p50 if s.ttft else None,
    "TTFT p90": lambda s: s.ttft.p90 if s.ttft else None,
    "TPOT p50": lambda s: s.tpot.p50 if s.tpot else None,
    "E2E p50": lambda s: s.e2e.p50 if s.e2e else None,
    "req/s": lambda s: s.request_throughput,
    "out tok/s": lambda s: s.output_throughput,
}


@dataclass(frozen=True)
class Comparison:
    """A claim the benchmark checks: ``row`` against ``reference`` (ratio < 1 means ``row`` is faster)."""

    claim: str
    row: str
    reference: str


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table; the first column left-aligned, the others right-aligned."""
    align = [":---"] + ["---:"] * (len(headers) - 1)
    lines = [_md_row(headers), _md_row(align)]
    lines += [_md_row(r) for r in rows]
    return "\n".join(lines)


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def fmt_num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def latency_table(stats: Sequence[ScenarioStats]) -> str:
    """Absolute numbers: one row per scenario, times in milliseconds."""
    headers = ["scenario", "ok", "fail", "TTFT p50", "p90", "p99", "TPOT p50", "p90", "p99"]
    headers += ["E2E p50", "p90", "p99", "out tok", "req/s", "out tok/s", "prefix hit"]
    headers += ["enc hits", "enc misses", "enc items"]
    rows = [_latency_row(s) for s in stats]
    return markdown_table(headers, rows)


def _latency_row(s: ScenarioStats) -> list[str]:
    row = [s.name, str(s.completed), str(s.failed)]
    for d in (s.ttft, s.tpot, s.e2e):
        row += [fmt_ms(d.p50 if d else None), fmt_ms(d.p90 if d else None), fmt_ms(d.p99 if d else None)]
    hit = s.prefix_hit_rate
    row += [str(s.output_tokens), fmt_num(s.request_throughput), fmt_num(s.output_throughput, 1)]
    row.append("-" if hit is None else f"{hit:.0%}")
    server = s.server or {}
    for key in ("encoder_cache_hits", "encoder_cache_misses", "encoder_items_dispatched"):
        row.append(str(server[key]) if key in server else "-")
    return row


def ratio_table(stats: Sequence[ScenarioStats], baseline: str) -> str:
    """Every row's metrics divided by the baseline row's (the baseline row reads 1.00)."""
    by_name = {s.name: s for s in stats}
    if baseline not in by_name:
        raise ValueError(f"baseline row {baseline!r} is not among {list(by_name)}")
    base = by_name[baseline]
    headers = ["scenario"] + [f"{m} ×{baseline}" for m in RATIO_METRICS]
    rows = [[s.name] + [fmt_ratio(ratio(f(s), f(base))) for f in RATIO_METRICS.values()] for s in stats]
    return markdown_table(headers, rows)


def comparison_ratios(stats: Sequence[ScenarioStats], comparison: Comparison) -> dict[str, float | None]:
    by_name = {s.name: s for s in stats}
    row, ref = by_name.get(comparison.row), by_name.get(comparison.reference)
    if row is None or ref is None:
        return dict.fromkeys(RATIO_METRICS)
    return {name: ratio(f(row), f(ref)) for name, f in RATIO_METRICS.items()}


def comparison_table(stats: Sequence[ScenarioStats], comparisons: Sequence[Comparison]) -> str:
    """The claims, one per row: ``row / reference`` for TTFT and E2E."""
    keys = ["TTFT p50", "TTFT p90", "E2E p50"]
    headers = ["claim", "row", "vs", *keys]
    rows = []
    for c in comparisons:
        r = comparison_ratios(stats, c)
        rows.append([c.claim, c.row, c.reference] + [fmt_ratio(r[k]) for k in keys])
    return markdown_table(headers, rows)
