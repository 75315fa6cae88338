"""The tables of ``cluster.bench.pd_vs_colocated`` and the KV transfer read from the replicas' counters
(pure: no processes, no I/O)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cluster.bench.stats import fmt_num, markdown_table, ratio
from cluster.cpu_affinity import format_cpus

KV_KEYS = (
    "kv_imports",
    "kv_blocks_pulled",
    "kv_bytes_pulled",
    "kv_import_cpu_s",
    "kv_export_cpu_s",
    "kv_pull_wall_s",
)


def _llm_replicas(stats: Mapping[str, object]) -> dict[str, Mapping[str, object]]:
    """Every model's LLM replicas (both roles of an E/P/D model) in a ``/stats?pools=true`` answer."""
    out: dict[str, Mapping[str, object]] = {}
    for model, body in stats.items():
        pools = body.get("pools") if isinstance(body, Mapping) else None
        replicas = pools.get("llm_replicas") if isinstance(pools, Mapping) else None
        if isinstance(replicas, Mapping):
            out.update({f"{model}/{rid}": s for rid, s in replicas.items() if isinstance(s, Mapping)})
    return out


def replica_cores(stats: Mapping[str, object]) -> dict[str, list[int]]:
    """Each replica's ``cpu_affinity`` (the cores its threads may use) by ``<role, encoder or
    ingress>/<replica>``: the LLM replicas, the encoder replica that answered for its pool, and the
    ingress replica that answered ``/stats``."""
    out: dict[str, list[int]] = {}
    for name, s in _llm_replicas(stats).items():
        llm_cores = s.get("cpu_affinity")
        if isinstance(llm_cores, list):
            out[f"{s.get('role', 'llm')}/{name.split('/', 1)[1]}"] = list(llm_cores)
    for body in stats.values():
        pools = body.get("pools") if isinstance(body, Mapping) else None
        for pool, key in (("encoder", "preparing_replica"), ("ingress", "ingress_replica")):
            one = pools.get(key) if isinstance(pools, Mapping) else None
            cores = one.get("cpu_affinity") if isinstance(one, Mapping) else None
            if isinstance(one, Mapping) and isinstance(cores, list):
                out[f"{pool}/{one.get('replica_id', '?')}"] = list(cores)
    return out


def cores_line(rows: Sequence[Mapping[str, object]]) -> str:
    """Where each server's replicas ran: ``colocated: both/ab12 0, both/cd34 1, encoder/ef56 0-1``."""
    parts = []
    for row in rows:
        cores = row.get("cores")
        if isinstance(cores, Mapping) and cores:
            placed = ", ".join(f"{name} {format_cpus(c)}" for name, c in sorted(cores.items()))
            parts.append(f"{row['server']}: {placed}")
    return "Replicas' cores (cpu_affinity): " + "; ".join(parts) if parts else ""


def kv_transfer(before: Mapping[str, object], after: Mapping[str, object]) -> dict[str, float] | None:
    """The ``kv_*`` counters summed over the LLM replicas, ``after - before`` (a replica missing from
    ``before`` counts from zero); None when no replica has them (colocated, vLLM)."""
    then, now = _llm_replicas(before), _llm_replicas(after)
    totals = dict.fromkeys(KV_KEYS, 0.0)
    seen = False
    for rid, stats in now.items():
        old = then.get(rid, {})
        for key in KV_KEYS:
            value = stats.get(key)
            if isinstance(value, int | float):
                seen = True
                prior = old.get(key, 0.0)
                totals[key] += float(value) - (float(prior) if isinstance(prior, int | float) else 0.0)
    return totals if seen else None


def kv_per_request(kv: Mapping[str, float] | None) -> tuple[float | None, float | None]:
    """(MB moved, CPU-ms) per imported request: the blocks' bytes, and the prefill side's read plus the
    decode side's write of them."""
    if not kv or not kv.get("kv_imports"):
        return None, None
    n = kv["kv_imports"]
    cpu_s = kv.get("kv_import_cpu_s", 0.0) + kv.get("kv_export_cpu_s", 0.0)
    return kv["kv_bytes_pulled"] / n / 1e6, cpu_s * 1000 / n


def _ms(x: object) -> float | None:
    return float(x) * 1000 if isinstance(x, int | float) else None


def _pair_ms(x: object, i: int) -> float | None:
    return _ms(x[i]) if isinstance(x, list | tuple) else None


def server_table(rows: Sequence[Mapping[str, object]]) -> str:
    headers = [
        "server",
        "ok",
        "failed",
        "ITL p50 ms",
        "ITL p99 ms",
        "short ITL p99 ms",
        "TTFT long p50 / p99 ms",
    ]
    headers += [
        "TTFT short p50 / p99 ms",
        "SLO met",
        "goodput req/s",
        "KV MB/req",
        "KV CPU-ms/req",
        "CPU-ms/req",
        "host load",
    ]
    out = []
    for row in rows:
        s = row["summary"]
        assert isinstance(s, Mapping)
        ttft = s["ttft"]
        assert isinstance(ttft, Mapping)
        mb, kv_ms = kv_per_request(row.get("kv"))  # type: ignore[arg-type]
        cells = [str(row["server"]), str(s["completed"]), str(s["failed"])]
        cells += [fmt_num(_ms(s[k]), 1) for k in ("itl_p50_s", "itl_p99_s", "short_itl_p99_s")]
        for kind in ("long", "short"):
            cells.append(f"{fmt_num(_pair_ms(ttft[kind], 0), 0)} / {fmt_num(_pair_ms(ttft[kind], 1), 0)}")
        cells += [str(s["slo_met"]), fmt_num(s["goodput"]), fmt_num(mb, 3), fmt_num(kv_ms, 2)]  # type: ignore[arg-type]
        cells.append(fmt_num(row.get("cpu_ms_per_request"), 0))  # type: ignore[arg-type]
        load = row.get("host_load")  # the 1-min load average before and after the measured load
        cells.append(f"{load[0]:.1f} → {load[1]:.1f}" if isinstance(load, list | tuple) else "-")
        out.append(cells)
    return markdown_table(headers, out)


def target_table(rows: Sequence[Mapping[str, object]], reference: str = "colocated") -> str:
    """Every server over ``reference``: decode ITL p99 (target ≤ 0.5 for pd) and goodput (≥ 1.3)."""
    by = {str(r["server"]): r["summary"] for r in rows}
    ref = by.get(reference)
    if not isinstance(ref, Mapping):
        return f"(no {reference} row: no ratios)"
    out = []
    for name, s in by.items():
        assert isinstance(s, Mapping)
        itl = ratio(s["itl_p99_s"], ref["itl_p99_s"])
        short = ratio(s["short_itl_p99_s"], ref["short_itl_p99_s"])
        good = ratio(s["goodput"], ref["goodput"])
        out.append([name, fmt_num(itl), fmt_num(short), fmt_num(good)])
    return markdown_table([f"server / {reference}", "ITL p99 ×", "short ITL p99 ×", "goodput ×"], out)


def render(rows: Sequence[Mapping[str, object]], header: str) -> str:
    return "\n\n".join(
        [
            "## Colocated vs prefill/decode (`python -m cluster.bench.pd_vs_colocated`)",
            header,
            *([cores_line(rows)] if cores_line(rows) else []),
            server_table(rows),
            target_table(rows),
        ]
    )
