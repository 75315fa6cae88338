"""The loads of ``cluster.bench.vs_vllm`` and its tables (pure: no processes, no I/O)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cluster.bench.cpu_profile import IdleProfile, ScenarioProfile, profile_table
from cluster.bench.json_body import JSON, json_float
from cluster.bench.stats import fmt_num, markdown_table, ratio

REFERENCE = "vLLM"


@dataclass(frozen=True)
class Load:
    name: str
    dataset: str  # "random-mm" (one image per request) | "random" (text only)
    num_prompts: int
    concurrency: int  # at most this many in flight
    # Arrivals per second (Poisson); inf: closed loop, each of `concurrency` clients sends its next
    # request when its last one ends. Under a closed loop Little's law ties mean TTFT to TPOT at a
    # given req/s (c = req/s x (TTFT + (n_out - 1) x TPOT + the client's gap)); at a fixed rate below
    # both servers' capacity it does not, and TTFT is what a request waits at that load.
    request_rate: float = math.inf
    key: str = ""  # what `--loads` names it by
    items: int = 1  # media items per request (random-mm), all distinct
    # JSON merged into every request's body for this load alone (``--paired-body``'s twin loads)
    extra_body: str | None = None
    # added to the run's seed: a twin draws other requests of the same shape, so it does not find its
    # images and prompts in the caches the load before it filled
    seed_offset: int = 0


LOADS = [
    Load("image, 128 req, c=32", "random-mm", 128, 32, key="image-c32"),
    Load("image, 48 req, c=1", "random-mm", 48, 1, key="image-c1"),
    Load("4 images, 128 req, c=32", "random-mm", 128, 32, key="image4-c32", items=4),
    Load("4 images, 32 req, c=1", "random-mm", 32, 1, key="image4-c1", items=4),
    Load("4 images, 64 req, c=8", "random-mm", 64, 8, key="image4-c8", items=4),
    Load("text, 128 req, c=32", "random", 128, 32, key="text-c32"),
    Load("image, 256 req, 30 req/s", "random-mm", 256, 256, request_rate=30.0, key="image-rate30"),
]
WARMUP = Load("warm-up", "random-mm", 32, 32, key="warm-up")
# what --paired-body compares pair by pair
PAIRED_METRICS = ("mean_tpot_ms", "request_throughput", "cpu_ms_per_request")


def paired(loads: Sequence[Load], body: str, label: str, repeats: int = 1) -> list[Load]:
    """Each load, then its twin with ``body`` merged into every request (named ``<load>, <label>``)
    and a seed of its own: the same server process runs both, one after the other, so their ratio
    comes from one run, and the twin does not hit the caches its load just filled. ``repeats`` pairs
    per load, every other one twin first (ABBA: a drift over the run weighs on both sides alike), each
    pair with seeds of its own; the repeats keep their load's name, so a table shows their median."""
    out: list[Load] = []
    for load in loads:
        for k in range(repeats):
            base = replace(load, seed_offset=2 * k)
            twin = replace(
                load,
                name=f"{load.name}, {label}",
                key=f"{load.key}+{label}",
                extra_body=body,
                seed_offset=2 * k + 1,
            )
            out += [base, twin] if k % 2 == 0 else [twin, base]
    return out


def paired_ratios(results: Sequence[LoadResult], label: str, metrics: Sequence[str] = PAIRED_METRICS) -> str:
    """Per server and load, the twin's metric over its load's, pair by pair (the k-th run of the load
    with the k-th run of its twin: adjacent in time), as the median (of an even count: the mean of the middle two) and the range over the pairs: the
    with/without reading of ``--paired-body`` that a drift between pairs does not move."""
    runs: dict[tuple[str, str], list[LoadResult]] = {}
    for r in results:
        runs.setdefault((r.server, r.load.name), []).append(r)
    suffix = f", {label}"
    headers = ["server", "load", "pairs"]
    for m in metrics:
        headers += [f"{m} ×without (median)", "range"]
    rows = []
    for (server, name), twins in runs.items():
        if not name.endswith(suffix):
            continue
        bases = runs.get((server, name[: -len(suffix)]), [])
        row = [server, name, str(min(len(bases), len(twins)))]
        for m in metrics:
            got = sorted(
                q
                for b, t in zip(bases, twins, strict=False)
                if (q := ratio(t.value(m), b.value(m))) is not None
            )
            row += (
                [fmt_num(statistics.median(got)), f"{fmt_num(got[0])}–{fmt_num(got[-1])}"]
                if got
                else ["-", "-"]
            )
        rows.append(row)
    return markdown_table(headers, rows)


def select_loads(keys: str | None) -> list[Load]:
    """The loads ``--loads`` names (comma-separated keys), in the table's order; all by default."""
    if not keys:
        return list(LOADS)
    wanted = {k.strip() for k in keys.split(",") if k.strip()}
    unknown = wanted - {load.key for load in LOADS}
    if unknown:
        raise ValueError(f"--loads: unknown {sorted(unknown)}; have {[load.key for load in LOADS]}")
    return [load for load in LOADS if load.key in wanted]


@dataclass
class LoadResult:
    server: str
    load: Load
    metrics: JSON  # the result JSON of `vllm bench serve`
    profile: ScenarioProfile

    @property
    def cpu_ms_per_request(self) -> float | None:
        return self.profile.total_ms / self.profile.requests if self.profile.requests else None

    def value(self, key: str) -> float | None:
        if key == "cpu_ms_per_request":
            return self.cpu_ms_per_request
        v = self.metrics.get(key)
        return None if v is None else json_float(v)


# (column label, key of the result JSON, or "cpu_ms_per_request")
COLUMNS = [
    ("req/s", "request_throughput"),
    ("mean TTFT ms", "mean_ttft_ms"),
    ("mean TPOT ms", "mean_tpot_ms"),
    ("ITL p50 ms", "median_itl_ms"),
    ("CPU-ms/req", "cpu_ms_per_request"),
]


def comparison_table(
    results: Sequence[LoadResult], servers: Sequence[str], loads: Sequence[Load] = LOADS
) -> str:
    """One row per load and server: each metric and its ratio to vLLM's on the same load."""
    by = {(r.server, r.load.name): r for r in results}
    headers = ["load", "server"]
    for label, _ in COLUMNS:
        headers += [label, f"×{REFERENCE}"]
    rows = []
    for load in loads:
        ref = by.get((REFERENCE, load.name))
        for server in servers:
            r = by.get((server, load.name))
            row = [load.name, server]
            for _, key in COLUMNS:
                v = r.value(key) if r else None
                row += [fmt_num(v, 1), fmt_num(ratio(v, ref.value(key) if ref else None))]
            rows.append(row)
    return markdown_table(headers, rows)


def render(
    results: Sequence[LoadResult],
    idles: dict[str, IdleProfile],
    servers: Sequence[str],
    header: str,
    loads: Sequence[Load] = LOADS,
) -> str:
    parts = ["## mmserve vs vLLM (`vllm bench serve`, same model dir, one server after the other)", header]
    parts.append(comparison_table(results, servers, loads))
    for server in servers:
        profiles = [r.profile for r in results if r.server == server]
        if profiles:
            parts += [
                f"### {server}: CPU-ms per completed request, by process",
                profile_table(profiles, idles.get(server)),
            ]
    return "\n\n".join(parts)


def suspect(r: LoadResult) -> bool:
    """A closed-loop round whose client saw more requests in flight than it may send at once: its
    timestamps are not the server's (one such vLLM round here showed 95 in flight at c=32 and a TPOT
    p50 of 0.004 ms: tokens held, then flushed together)."""
    seen = r.value("max_concurrent_requests")
    return math.isinf(r.load.request_rate) and seen is not None and seen > r.load.concurrency


def median_rounds(
    rounds: Sequence[Sequence[LoadResult]],
) -> tuple[list[LoadResult], dict[tuple[str, str], str]]:
    """Per (server, load), the round whose req/s is the median (the lower middle of an even count),
    with every metric and the CPU profile of that same round; and each pair's req/s range
    ("min–max"), for the header. ``suspect`` rounds are left out of the median while the pair has
    another (the range names how many were). One round passes through unchanged."""
    by_pair: dict[tuple[str, str], list[LoadResult]] = {}
    for results in rounds:
        for r in results:
            by_pair.setdefault((r.server, r.load.name), []).append(r)
    picked: list[LoadResult] = []
    spread: dict[tuple[str, str], str] = {}
    for pair, runs in by_pair.items():
        sound = [r for r in runs if not suspect(r)] or runs
        ranked = sorted(sound, key=lambda r: r.value("request_throughput") or 0.0)
        picked.append(ranked[(len(ranked) - 1) // 2])
        lo, hi = ranked[0].value("request_throughput") or 0.0, ranked[-1].value("request_throughput") or 0.0
        spread[pair] = f"{lo:.1f}–{hi:.1f}" + (
            f" ({len(runs) - len(sound)} suspect round(s) left out)" if len(sound) < len(runs) else ""
        )
    order = {pair: i for i, pair in enumerate(by_pair)}
    picked.sort(key=lambda r: order[(r.server, r.load.name)])
    return picked, spread


def results_json(results: Sequence[LoadResult], idles: dict[str, IdleProfile], header: str) -> JSON:
    rows = [
        {
            "server": r.server,
            "load": r.load.__dict__,
            "metrics": _slim(r.metrics),
            "profile": r.profile.to_json(),
        }
        for r in results
    ]
    return {"header": header, "results": rows, "idle": {k: v.to_json() for k, v in idles.items()}}


def _slim(metrics: JSON) -> JSON:
    """The result JSON without its per-request arrays."""
    return {k: v for k, v in metrics.items() if not isinstance(v, list)}
