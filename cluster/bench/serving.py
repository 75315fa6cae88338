"""Serving benchmark, in the manner of ``vllm bench serve``: ``python -m cluster.bench``.

Starts the app with the built-in tiny models on an embedded local Ray (127.0.0.1 only), or targets a
running server with ``--base-url``; drives it with the ``openai`` AsyncOpenAI client, streaming, at a
fixed concurrency; prints markdown tables of latencies and of ratios between the rows of one run.
Scenarios (in order): text only (the baseline), distinct images (cold caches), the same images again
(warm), the same images by ``uuid`` alone, and a mix of text, new images and audio.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from cluster.bench.client import fetch_counters, make_client, run_requests
from cluster.bench.cpu_profile import IdleProfile, ScenarioProfile, process_costs, profile_table
from cluster.bench.procs import CLOCK_TICKS_PER_S
from cluster.bench.profiler import Profiler
from cluster.bench.stats import (
    RequestResult,
    ScenarioStats,
    comparison_ratios,
    comparison_table,
    counter_deltas,
    latency_table,
    ratio_table,
    summarize,
)
from cluster.bench.workload import COMPARISONS, Scenario, WorkloadConfig, build_scenarios, warmup_requests

if TYPE_CHECKING:
    import openai
    from tqdm import tqdm

    from cluster.bench.cpu_profile import ProcSample

BASELINE = "text"


@dataclass
class BenchReport:
    header: dict[str, object]
    rows: list[ScenarioStats] = field(default_factory=list)
    requests: dict[str, list[RequestResult]] = field(default_factory=dict)
    profiles: list[ScenarioProfile] = field(default_factory=list)
    profile_notes: list[str] = field(default_factory=list)
    idle: IdleProfile | None = None

    @property
    def failed(self) -> int:
        return sum(not r.ok for rs in self.requests.values() for r in rs)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cluster.bench", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--base-url", help="target this server (e.g. http://127.0.0.1:8000/v1) instead of starting one"
    )
    p.add_argument("--port", type=int, default=8433, help="port of the embedded app (on 127.0.0.1)")
    p.add_argument("--config", help="AppConfig YAML for the embedded app (default: the tiny models)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the embedded Ray (default: all)")
    p.add_argument("--num-requests", type=int, default=32, help="requests per scenario")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (ignore_eos)")
    p.add_argument("--image-size", default="224x224", help="WIDTHxHEIGHT of generated images")
    p.add_argument("--audio-seconds", type=float, default=2.0, help="length of generated audio clips")
    p.add_argument("--model", default="tiny-qwen2-vl", help="the text+image model")
    p.add_argument("--audio-model", default="tiny-qwen2-audio", help="the audio model ('' leaves audio out)")
    p.add_argument("--seed", type=int, default=None, help="run id: media seeds and uuids (default: random)")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, seconds")
    p.add_argument("--json", type=Path, help="write the raw numbers (rows and every request) here")
    p.add_argument(
        "--disable-tqdm", action="store_true", help="no progress bar per scenario (as `vllm bench serve`'s)"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="CPU-ms per request by process of the app (read from /proc before and after each scenario)",
    )
    p.add_argument(
        "--profile-idle",
        type=float,
        default=5.0,
        help="with --profile: seconds of idle background to measure first",
    )
    args = p.parse_args(argv)
    if args.num_requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        p.error("--num-requests, --concurrency and --max-tokens must be >= 1")
    return args


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    try:
        width, height = (int(v) for v in args.image_size.lower().split("x"))
    except ValueError as e:
        raise SystemExit(f"--image-size must look like 224x224, got {args.image_size!r}") from e
    return WorkloadConfig(
        num_requests=args.num_requests,
        image_width=width,
        image_height=height,
        audio_seconds=args.audio_seconds,
        vl_model=args.model,
        audio_model=args.audio_model or None,
        run_id=args.seed if args.seed is not None else random.randrange(10**6),
    )


def start_embedded(args: argparse.Namespace) -> str:
    """The whole app on an embedded local Ray, HTTP on 127.0.0.1 only; returns its base URL."""
    from cluster.config import AppConfig, default_config
    from cluster.one_machine import one_machine_defaults
    from cluster.serve_cli import start

    cfg = AppConfig.from_yaml(args.config) if args.config else default_config()
    data = {**cfg.model_dump(), "host": "127.0.0.1", "port": args.port}
    one_machine_defaults(cfg, data)  # what `mmserve serve` runs
    cfg = AppConfig.model_validate(data)
    log(f"starting the app on an embedded Ray (port {args.port}) ...")
    start(cfg, num_cpus=args.num_cpus)
    return f"http://127.0.0.1:{args.port}/v1"


def stop_embedded() -> None:
    """Stop the embedded Ray; the app goes with it (the cluster is this process's own)."""
    import ray

    ray.shutdown()


def make_profiler(args: argparse.Namespace, base_url: str) -> Profiler:
    """The embedded app's processes hang under this one; a running server is found by its port."""
    if args.base_url is None:
        prof = Profiler(os.getpid(), own_kind="bench client + Ray driver")
    else:
        port = urlsplit(base_url).port or (443 if base_url.startswith("https") else 80)
        prof = Profiler.for_server(port)
    prof.connect_ray()
    for note in prof.notes:
        log(f"profile: {note}")
    return prof


async def run_benchmark(
    base_url: str, wl: WorkloadConfig, args: argparse.Namespace, profiler: Profiler | None = None
) -> BenchReport:
    client = make_client(base_url, args.timeout)
    scenarios = build_scenarios(wl)
    await warm_up(client, wl, args.max_tokens)
    freeze_gc_heap()
    report = BenchReport(header=run_header(base_url, wl, args))
    if profiler and args.profile_idle > 0:
        report.idle = await measure_idle(profiler, args.profile_idle)
    for scenario in scenarios:
        before = await fetch_counters(base_url)
        cpu_before = profiler.snapshot() if profiler else {}
        with progress_bar(len(scenario.requests), scenario.name, args.disable_tqdm) as bar:
            results, duration = await run_requests(
                client, scenario.requests, args.concurrency, args.max_tokens, on_done=bar.update
            )
        cpu_after = profiler.snapshot() if profiler else {}
        server = counter_deltas(before, await fetch_counters(base_url))
        report.requests[scenario.name] = results
        report.rows += scenario_rows(scenario, results, duration, server)
        if profiler:
            report.profiles.append(scenario_profile(report.rows, scenario.name, cpu_before, cpu_after))
        log_scenario(scenario, results, duration)
    report.profile_notes = profiler.notes if profiler else []
    await client.close()
    return report


async def warm_up(client: openai.AsyncOpenAI, wl: WorkloadConfig, max_tokens: int) -> None:
    """One request of each kind first, so model loading and first calls stay out of the rows."""
    results, _ = await run_requests(client, warmup_requests(wl), 3, max_tokens)
    errors = [r.error for r in results if not r.ok]
    if errors:
        raise SystemExit(f"warm-up requests failed: {errors}")


def freeze_gc_heap() -> None:
    """Move everything alive now (imports, the client, every scenario's request bodies) out of the
    collector's reach, as vLLM's servers do after start-up: otherwise a full collection of this
    process (40-53 ms here, about once a run) stalls the requests in flight and shows
    up as server latency."""
    gc.collect()
    gc.freeze()


async def measure_idle(profiler: Profiler, seconds: float) -> IdleProfile:
    before = profiler.snapshot()
    t0 = time.perf_counter()
    await asyncio.sleep(seconds)
    after = profiler.snapshot()
    return IdleProfile(time.perf_counter() - t0, process_costs(before, after, CLOCK_TICKS_PER_S))


def scenario_profile(
    rows: list[ScenarioStats], name: str, before: dict[int, ProcSample], after: dict[int, ProcSample]
) -> ScenarioProfile:
    row = next(r for r in rows if r.name == name)
    return ScenarioProfile(
        name=name,
        requests=row.completed,
        request_throughput=row.request_throughput,
        ttft_p50_s=row.ttft.p50 if row.ttft else None,
        costs=process_costs(before, after, CLOCK_TICKS_PER_S),
    )


def scenario_rows(
    scenario: Scenario, results: list[RequestResult], duration: float, server: dict[str, int] | None
) -> list[ScenarioStats]:
    """The scenario's row; a split scenario adds ``name:kind`` rows (server counters stay on the first)."""
    rows = [summarize(scenario.name, results, duration, server)]
    if scenario.split_by_kind:
        kinds = dict.fromkeys(s.kind for s in scenario.requests)
        for kind in kinds:
            subset = [r for r in results if r.kind == kind]
            rows.append(summarize(f"{scenario.name}:{kind}", subset, duration))
    return rows


def run_header(base_url: str, wl: WorkloadConfig, args: argparse.Namespace) -> dict[str, object]:
    return {
        "base_url": base_url,
        "run_id": wl.run_id,
        "requests_per_scenario": wl.num_requests,  # the mix sends this many of each kind
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "image_size": f"{wl.image_width}x{wl.image_height}",
        "audio_seconds": wl.audio_seconds,
        "model": wl.vl_model,
        "audio_model": wl.audio_model,
    }


def render(report: BenchReport) -> str:
    h = report.header
    setup = ", ".join(f"{k}={v}" for k, v in h.items())
    parts = [
        "## mmserve serving benchmark",
        setup,
        "### Latency (ms) and throughput per scenario",
        latency_table(report.rows),
        f"### Ratios to `{BASELINE}` (< 1: lower than text only)",
        ratio_table(report.rows, BASELINE),
        "### Claims (ratio row / vs; < 1: the row is faster)",
        comparison_table(report.rows, COMPARISONS),
    ]
    if report.profiles:
        parts += [
            "### CPU-ms per completed request, by process (user + sys)",
            profile_table(report.profiles, report.idle),
        ]
        parts += [f"note: {n}" for n in report.profile_notes]
    return "\n\n".join(parts)


def to_json(report: BenchReport) -> dict[str, object]:
    return {
        "header": report.header,
        "rows": [{**asdict(r), "prefix_hit_rate": r.prefix_hit_rate} for r in report.rows],
        "comparisons": [{**asdict(c), "ratios": comparison_ratios(report.rows, c)} for c in COMPARISONS],
        "requests": {k: [{**asdict(r), "tpot_s": r.tpot_s} for r in rs] for k, rs in report.requests.items()},
        "profile": [p.to_json() for p in report.profiles],
        "profile_notes": report.profile_notes,
        "profile_idle": report.idle.to_json() if report.idle else None,
    }


def progress_bar(total: int, desc: str, disable: bool = False) -> tqdm:
    """A bar of requests done on stderr, as `vllm bench serve` shows (tqdm)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=disable, file=sys.stderr, leave=False)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def log_scenario(scenario: Scenario, results: list[RequestResult], duration: float) -> None:
    failed = [r for r in results if not r.ok]
    log(f"{scenario.name}: {len(results) - len(failed)}/{len(results)} ok in {duration:.1f} s")
    for r in failed[:3]:
        log(f"  failed ({r.kind}): {r.error}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wl = workload_config(args)
    base_url = args.base_url or start_embedded(args)
    try:
        profiler = make_profiler(args, base_url) if args.profile else None
        report = asyncio.run(run_benchmark(base_url, wl, args, profiler))
    finally:
        if args.base_url is None or args.profile:
            stop_embedded()  # the embedded app, or only our connection to the server's Ray
    print(render(report), flush=True)
    if args.json:
        args.json.write_text(json.dumps(to_json(report), indent=2))
        log(f"raw numbers written to {args.json}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
