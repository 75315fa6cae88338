"""CPU time per request by process of the app: the benchmark's ``--profile``.

Before and after each scenario the benchmark reads the CPU time (user + sys, every thread) of every
process of the app's Ray cluster (found by ``cluster.bench.profiler``) and of itself; the difference, summed over
the processes of one kind (the replicas of one deployment, the shards of the cache index, ...) and
divided by the requests the scenario completed, is that kind's CPU-ms per request. A process's kind
comes from its Ray actor class (Ray's state API, or the GCS actor table when the dashboard has no
state API) and otherwise from its title: Ray names an actor's worker ``ray::ClassName``.

Caveats, by construction: CPU a process spent and then exited with during the scenario is lost; a
process started during it counts with all of its CPU time; background work (health checks, metrics,
autoscaling) lands in whatever scenario it falls in, which the idle column (CPU-ms per second with
nothing in flight) lets a reader subtract.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from cluster.bench.stats import fmt_num, markdown_table

BENCH_CLIENT = "bench client"
DRIVER = "driver"
IDLE_WORKERS = "idle Ray workers"

# Actor classes (Ray's own) under a plainer name; a Serve replica is named after its deployment.
CLASS_KINDS = {
    "ProxyActor": "Serve proxy",
    "ServeController": "Serve controller",
    "DashboardAgent": "dashboard agent",
    "RuntimeEnvAgent": "runtime-env agent",
    "IDLE": IDLE_WORKERS,
}
# Non-actor processes, by a fragment of the program's path (first match wins).
PROGRAM_KINDS = (
    ("gcs_server", "GCS server"),
    ("dashboard/agent.py", "dashboard agent"),
    ("dashboard/dashboard.py", "dashboard"),
    ("runtime_env/agent/main.py", "runtime-env agent"),
    ("log_monitor.py", "log monitor"),
    ("autoscaler/_private/monitor.py", "autoscaler monitor"),
    ("workers/default_worker.py", IDLE_WORKERS),  # a worker before it becomes an actor
)


def class_kind(actor_class: str) -> str:
    """``ServeReplica:mmserve:LLMServer-m`` -> ``LLMServer-m``; ``CacheIndexShard.commit`` -> ``CacheIndexShard``."""
    name = actor_class.removeprefix("ray::").strip()
    if name.startswith("ServeReplica:"):
        return name.split(":", 2)[2] if name.count(":") >= 2 else name
    name = name.split(".", 1)[0].split("(", 1)[0]
    return CLASS_KINDS.get(name, name)


def process_kind(title: str, actor_class: str | None = None) -> str:
    """The kind a process counts under: its actor class if known, else what its title says."""
    if actor_class:
        return class_kind(actor_class)
    words = title.split()
    if not words:
        return "unknown"
    if words[0].startswith("ray::"):
        return class_kind(words[0])
    if words[0] == "raylet" or words[0].endswith("/raylet"):
        return "raylet"
    head = " ".join(words[:3])
    for fragment, kind in PROGRAM_KINDS:
        if fragment in head:
            return kind
    return program_name(words)


def program_name(words: Sequence[str]) -> str:
    """``python -m pkg.mod`` -> ``pkg.mod``; ``python x/y.py`` -> ``y.py``; ``python -c ...`` -> ``python -c``."""
    prog = PurePosixPath(words[0]).name
    if not prog.startswith("python"):
        return prog
    args = list(words[1:])
    while args and args[0].startswith("-"):
        flag = args.pop(0)
        if flag == "-m" and args:
            return args[0]
        if flag == "-c":  # e.g. multiprocessing's resource tracker
            return f"{prog} -c"
    return PurePosixPath(args[0]).name if args else prog


# -- before/after arithmetic (pure) -------------------------------------------------------------------


@dataclass(frozen=True)
class ProcSample:
    """A process's CPU time at one instant and the kind it counts under."""

    pid: int
    start_ticks: int
    cpu_ticks: int
    kind: str
    title: str


@dataclass(frozen=True)
class ProcessCost:
    pid: int
    kind: str
    title: str
    cpu_ms: float


def process_costs(
    before: Mapping[int, ProcSample], after: Mapping[int, ProcSample], ticks_per_s: float
) -> list[ProcessCost]:
    """CPU spent between two snapshots by every process alive at the second; a pid whose start time
    changed is a new process and counts in full."""
    costs = []
    for pid, a in after.items():
        b = before.get(pid)
        base = b.cpu_ticks if b is not None and b.start_ticks == a.start_ticks else 0
        costs.append(ProcessCost(pid, a.kind, a.title, (a.cpu_ticks - base) * 1000 / ticks_per_s))
    return costs


@dataclass(frozen=True)
class KindCost:
    kind: str
    processes: int
    cpu_ms: float


def by_kind(costs: Sequence[ProcessCost]) -> list[KindCost]:
    """Costs summed per kind, most expensive first."""
    totals: dict[str, list[float]] = {}
    for c in costs:
        totals.setdefault(c.kind, []).append(c.cpu_ms)
    rows = [KindCost(k, len(v), sum(v)) for k, v in totals.items()]
    return sorted(rows, key=lambda r: (-r.cpu_ms, r.kind))


def per_request(cpu_ms: float, requests: int) -> float | None:
    return cpu_ms / requests if requests > 0 else None


@dataclass
class ScenarioProfile:
    """One scenario's CPU bill beside its throughput and latency."""

    name: str
    requests: int  # completed requests: the divisor
    request_throughput: float
    ttft_p50_s: float | None
    costs: list[ProcessCost] = field(default_factory=list)

    def kinds(self) -> list[KindCost]:
        return by_kind(self.costs)

    @property
    def total_ms(self) -> float:
        return sum(c.cpu_ms for c in self.costs)

    def to_json(self) -> dict[str, object]:
        kinds = self.kinds()
        return {
            "scenario": self.name,
            "requests": self.requests,
            "request_throughput": self.request_throughput,
            "ttft_p50_s": self.ttft_p50_s,
            "cpu_ms_total": self.total_ms,
            "cpu_ms_per_request": {k.kind: per_request(k.cpu_ms, self.requests) for k in kinds},
            "cpu_ms_per_request_total": per_request(self.total_ms, self.requests),
            "processes_per_kind": {k.kind: k.processes for k in kinds},
            "processes": [c.__dict__ for c in sorted(self.costs, key=lambda c: -c.cpu_ms)],
        }


@dataclass
class IdleProfile:
    """What the app burns with no request in flight: the background every scenario's bill includes."""

    seconds: float
    costs: list[ProcessCost] = field(default_factory=list)

    def ms_per_s(self, kind: str | None = None) -> float | None:
        ms = sum(c.cpu_ms for c in self.costs if kind is None or c.kind == kind)
        return ms / self.seconds if self.seconds > 0 else None

    def to_json(self) -> dict[str, object]:
        per_s = {k.kind: k.cpu_ms / self.seconds for k in by_kind(self.costs)} if self.seconds > 0 else {}
        return {"seconds": self.seconds, "cpu_ms_per_s": per_s}


def profile_table(profiles: Sequence[ScenarioProfile], idle: IdleProfile | None = None) -> str:
    """Kinds down, scenarios across: CPU-ms per completed request; req/s and TTFT p50 on top; with
    ``idle``, a last column of CPU-ms per second with nothing in flight."""
    totals: dict[str, float] = {}
    count: dict[str, int] = {}
    for p in profiles:
        for k in p.kinds():
            totals[k.kind] = totals.get(k.kind, 0.0) + k.cpu_ms
            count[k.kind] = max(count.get(k.kind, 0), k.processes)
    kinds = sorted(totals, key=lambda k: (-totals[k], k))
    headers = ["CPU-ms per request", *(p.name for p in profiles)]
    rows = [
        ["req/s", *(fmt_num(p.request_throughput) for p in profiles)],
        [
            "TTFT p50 (ms)",
            *(fmt_num(None if p.ttft_p50_s is None else p.ttft_p50_s * 1000, 1) for p in profiles),
        ],
        ["**total**", *(f"**{fmt_num(per_request(p.total_ms, p.requests), 1)}**" for p in profiles)],
    ]
    for kind in kinds:
        label = kind if count[kind] == 1 else f"{kind} (×{count[kind]})"
        rows.append([label, *(fmt_num(_kind_per_request(p, kind), 1) for p in profiles)])
    if idle is not None:
        headers.append(f"idle CPU-ms/s ({idle.seconds:.0f} s)")
        rows[0].append("")
        rows[1].append("")
        rows[2].append(f"**{fmt_num(idle.ms_per_s(), 1)}**")
        for row, kind in zip(rows[3:], kinds, strict=True):
            row.append(fmt_num(idle.ms_per_s(kind), 1))
    return markdown_table(headers, rows)


def _kind_per_request(p: ScenarioProfile, kind: str) -> float | None:
    ms = sum(c.cpu_ms for c in p.costs if c.kind == kind)
    return per_request(ms, p.requests)
