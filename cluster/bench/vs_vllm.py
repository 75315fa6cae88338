"""mmserve against vLLM 0.32 (CPU), one server after the other, same model directory, same load from
vLLM's own client: ``python -m cluster.bench.vs_vllm``.

For each server: start it on 127.0.0.1, wait for ``/health``, run one unmeasured warm-up pass, then
``vllm bench serve`` (``--backend openai-chat``, streaming, ``ignore_eos``, temperature 0) for every
load: 1 image of 64-224 px + 64 random text tokens and 16 output tokens (``random-mm``) at 128 requests
and concurrency 32 and at 48 requests and concurrency 1, the same lengths text only (``random``) at
concurrency 32, and 256 image requests arriving at random at 30 per second (an open loop: below both
servers' capacity here, so each request's TTFT is what it waits at that load, not a share of a
closed loop's fixed round trip); stop it. ``--loads`` picks some. Every load uses the same seed on
both servers, so both see the same requests. Around every load it reads the CPU time of each process of the server's tree (``/proc``) and
reports CPU-ms per completed request; the window opens when the client first connects (not when it
starts: it spends ~10 s importing vLLM and drawing its dataset, while the server idles). Needs the
peer venv: ``../shared/tools/peer_vllm/setup.sh``.

The servers (``--servers``, in order): ``vllm``; ``mmserve`` (``mmserve serve --model DIR``); ``cluster``,
the cluster deployment as the README tells users to start it (``ray start --head --num-cpus=4`` with
the README's environment, then ``serve deploy`` of ``cluster/deploy/serve-cpu.yaml`` with only the
model's path and name and Serve's HTTP port rewritten); ``cluster2``, the same on a local two-node
cluster: ``ray start --head --num-cpus=2 --resources='{"encoder_node": 1}'`` and ``ray start
--address=HEAD --num-cpus=2 --resources='{"llm_node": 1}'``, the encoder pool asking for a sliver of
``encoder_node`` and the LLM pool of ``llm_node`` (added to the config where it sets no resources), so
embeddings cross from one raylet's object store to the other's. A cluster's CPU counts every process
of it (GCS, raylets, dashboard, monitors, agents, Serve's controller, proxy and replicas).

``--paired-body JSON`` runs every load twice on each server start, without and then with that JSON merged
into every request (a ``response_format``): what a schema costs (TPOT with it against without) comes
from one run of one server process.

``--mmserve-baseline DIR`` also runs mmserve from another checkout (e.g. ``git archive <commit> | tar -x
-C DIR``), so a change is measured before and after in one run, under the same conditions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from cluster.bench import plots as bench_plots
from cluster.bench.cpu_profile import IdleProfile, ScenarioProfile, process_costs
from cluster.bench.procs import CLOCK_TICKS_PER_S, anyone_connected_to
from cluster.bench.servers import BenchServer, ClusterServer, RayNode, ServerProcess, pool_stats
from cluster.bench.stats import step_cpu_shares
from cluster.bench.vllm_client import QUIET_ENV, TCMALLOC, bench_argv
from cluster.bench.vs_args import parse_args
from cluster.bench.vs_report import (
    WARMUP,
    Load,
    LoadResult,
    median_rounds,
    paired_ratios,
    render,
    results_json,
)

ENCODER_NODE, LLM_NODE = {"encoder_node": 0.001}, {"llm_node": 0.001}  # as serve-gpu.yaml asks


def vllm_server(args: argparse.Namespace) -> ServerProcess:
    """``vllm serve`` of ``--model-dir`` from the peer venv (shared/tools/peer_vllm), float32, on
    ``--vllm-port``, with the environment of the peer's README."""
    vllm_env = {**QUIET_ENV, "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    iomp = args.vllm_venv / "lib/libiomp5.so"
    if TCMALLOC.exists() and iomp.exists():  # as vLLM's CPU docs ask (~30 % more throughput here)
        vllm_env["LD_PRELOAD"] = f"{TCMALLOC}:{iomp}"
    py, cli = str(args.vllm_venv / "bin/python"), str(args.peer_dir / "vllm_cli.py")
    argv = [py, cli, "serve", str(args.model_dir), "--served-model-name", args.served_name]
    argv += [
        "--host",
        "127.0.0.1",
        "--port",
        str(args.vllm_port),
        "--max-model-len",
        "4096",
        "--dtype",
        "float32",
    ]
    log_path = args.out_dir / "vllm-serve.log"
    return ServerProcess("vLLM", argv, args.vllm_port, log_path, env=vllm_env, root_kind="API server")


def make_servers(args: argparse.Namespace) -> dict[str, BenchServer]:
    servers: dict[str, BenchServer] = {
        "vllm": vllm_server(args),
        "mmserve": mmserve_server(
            args, "mmserve", args.mmserve_root, args.mmserve_port, args.mmserve_args.split()
        ),
        "overlap": mmserve_server(
            args,
            "mmserve+" + args.overlap_args.replace("--", "").replace(" ", "_"),
            args.mmserve_root,
            args.overlap_port,
            args.overlap_args.split(),
        ),
        "cluster": cluster_server(args, "cluster", args.cluster_port, [RayNode(args.cluster_num_cpus)]),
        "cluster2": cluster_server(
            args,
            "cluster2",
            args.cluster2_port,
            [
                RayNode(args.cluster_num_cpus // 2, {"encoder_node": 1}),
                RayNode(args.cluster_num_cpus - args.cluster_num_cpus // 2, {"llm_node": 1}),
            ],
            markers={"encoder": ENCODER_NODE, "llm": LLM_NODE},
        ),
    }
    if args.mmserve_baseline is not None:
        base = args.mmserve_baseline
        servers["baseline"] = mmserve_server(args, "mmserve@baseline", base, args.baseline_port)
    return servers


def mmserve_server(
    args: argparse.Namespace, name: str, root: Path, port: int, extra: list[str] | None = None
) -> ServerProcess:
    """``mmserve serve`` of the checkout at ``root`` (its own ``cluster`` package, this venv)."""
    argv = [sys.executable, "-m", "cluster.cli", "serve", "--model", str(args.model_dir), *(extra or [])]
    argv += ["--model-name", args.served_name, "--host", "127.0.0.1", "--port", str(port)]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    log_path = args.out_dir / f"{name}-serve.log"
    return ServerProcess(name, argv, port, log_path, env=env, cwd=root, root_kind="Ray driver")


def cluster_server(
    args: argparse.Namespace,
    name: str,
    port: int,
    nodes: list[RayNode],
    markers: dict[str, dict[str, float]] | None = None,
) -> ClusterServer:
    """``ray start`` of ``nodes`` and ``serve deploy`` of ``--cluster-config``, importing the app from
    ``--mmserve-root`` (cluster.bench.local_cluster: the README's environment, its own HOME and temp dir)."""
    return ClusterServer(
        name,
        args.cluster_config,
        port,
        args.model_dir,
        args.served_name,
        args.out_dir,
        nodes,
        markers or {},
        root=args.mmserve_root,
        env=dict(kv.split("=", 1) for kv in args.cluster_env),
    )


def run_load(
    args: argparse.Namespace, server: BenchServer, load: Load, seed: int, round_no: int = 0
) -> LoadResult:
    """One ``vllm bench serve`` run. The client takes seconds to start (importing vLLM, drawing its
    dataset) before its first connection, while the server idles; the CPU window opens at that
    connection (its ready check, then the run) and closes when the client exits, and the JSON keeps
    it (``window_s``) beside the run's own ``duration``."""
    rate = "" if math.isinf(load.request_rate) else f"-r{load.request_rate:g}"
    body = "-body" if load.extra_body else ""
    pair = f"-s{load.seed_offset}" if load.seed_offset else ""
    name = f"{server.name}-{load.dataset}-c{load.concurrency}{rate}-n{load.num_prompts}{body}{pair}-round{round_no}"
    result = args.out_dir / f"{name}.json"  # one per round: --json keeps only each pair's median
    argv = bench_argv(args, load, server.base_url, seed, result)
    log_path = result.with_suffix(".log")
    with log_path.open("wb") as out:
        client = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **QUIET_ENV})
        while client.poll() is None and not anyone_connected_to(server.port):
            time.sleep(0.02)
        pools_before = pool_stats(server.base_url)  # before the CPU window: its own cost stays out
        before = server.snapshot()
        t0 = time.monotonic()
        rc = client.wait()
        window_s = time.monotonic() - t0
    after = server.snapshot()
    shares = step_cpu_shares(pools_before, pool_stats(server.base_url))
    if rc != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve failed ({rc}) for {server.name} / {load.name}; see {log_path}")
    metrics = json.loads(result.read_text())
    metrics["window_s"] = window_s
    if shares:
        metrics["step_cpu_share"] = shares
    profile = ScenarioProfile(
        name=load.name,
        requests=int(metrics["completed"]),
        request_throughput=float(metrics["request_throughput"]),
        ttft_p50_s=float(metrics["median_ttft_ms"]) / 1000,
        costs=process_costs(before, after, CLOCK_TICKS_PER_S),
    )
    log(
        f"{server.name} / {load.name}: {metrics['completed']} ok, {metrics.get('failed', 0)} failed, "
        f"{metrics['request_throughput']:.1f} req/s, mean TTFT {metrics['mean_ttft_ms']:.0f} ms; "
        f"run {float(metrics.get('duration') or 0):.1f} s of a {window_s:.1f} s CPU window"
        + "".join(f"; {pool} steps ran {share:.0%} of their wall time" for pool, share in shares.items())
    )
    return LoadResult(server.name, load, metrics, profile)


def run_server(
    args: argparse.Namespace, server: BenchServer, round_no: int = 0
) -> tuple[list[LoadResult], IdleProfile]:
    log(f"starting {server.name}: {server.describe()}")
    try:
        server.start()
        log(f"{server.name} healthy after {server.wait_healthy(args.startup_timeout):.0f} s")
        run_load(args, server, WARMUP, seed=1000)
        for body in dict.fromkeys(load.extra_body for load in args.loads if load.extra_body):
            # a first structured request builds the grammar backend (seconds): not in a measured load
            run_load(args, server, replace(WARMUP, name="warm-up, body", extra_body=body), seed=1000)
        idle = measure_idle(server, args.idle_seconds)
        results = [
            run_load(args, server, load, args.seed + load.seed_offset, round_no) for load in args.loads
        ]
        return results, idle
    finally:
        server.stop()
        left = server.leftovers()
        log(f"{server.name} stopped" + (f"; still alive: {left}" if left else ""))


def measure_idle(server: BenchServer, seconds: float) -> IdleProfile:
    """The server's background CPU with nothing in flight (health checks, metrics, autoscaling)."""
    before = server.snapshot()
    t0 = time.monotonic()
    time.sleep(seconds)
    after = server.snapshot()
    return IdleProfile(time.monotonic() - t0, process_costs(before, after, CLOCK_TICKS_PER_S))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for need in (
        args.vllm_venv / "bin/python",
        args.peer_dir / "vllm_cli.py",
        args.model_dir / "config.json",
    ):
        if not need.exists():
            raise SystemExit(f"{need} is missing: run {args.peer_dir}/setup.sh first")
    servers = make_servers(args)
    order = [s.strip() for s in args.servers.split(",") if s.strip()]
    if args.mmserve_baseline is None and "baseline" in order and args.servers == "vllm,baseline,mmserve":
        order.remove("baseline")  # the default order names it; only --mmserve-baseline adds it
    unknown = [s for s in order if s not in servers]
    if unknown:
        raise SystemExit(f"--servers: unknown or not configured {unknown}; have {sorted(servers)}")
    load_avg = os.getloadavg()
    rounds: list[list[LoadResult]] = []
    idles: dict[str, IdleProfile] = {}
    for n in range(args.rounds):  # odd rounds in the reverse order: no server always goes first
        results: list[LoadResult] = []
        for key in order if n % 2 == 0 else order[::-1]:
            server_results, idles[servers[key].name] = run_server(args, servers[key], n)
            results += server_results
        rounds.append(results)
    picked, spread = median_rounds(rounds)
    header = (
        f"model_dir={args.model_dir}, input_len={args.input_len}, output_len={args.output_len}, seed={args.seed}, "
        f"cores={os.cpu_count()}, load average at start {load_avg[0]:.2f}, at end {os.getloadavg()[0]:.2f}"
    )
    if args.rounds > 1:
        ranges = "; ".join(f"{srv} / {load}: {r}" for (srv, load), r in spread.items())
        header += (
            f"\n\nmedian of {args.rounds} rounds by req/s (each row is that round's); req/s ranges: {ranges}"
        )
    names = [servers[k].name for k in order]
    shown = list({load.name: load for load in args.loads}.values())  # a load once, however many pairs
    print(render(picked, idles, names, header, shown), flush=True)
    if args.paired_body is not None:
        every = [r for results in rounds for r in results]
        print(f"\n### {args.paired_label} over without, pair by pair\n", flush=True)
        print(paired_ratios(every, args.paired_label), flush=True)
    for path in bench_plots.write(picked, names, shown, args.plots or args.out_dir):
        log(f"figure written to {path}")
    if args.json:
        data = results_json(picked, idles, header)
        if args.rounds > 1:
            data["rounds"] = [results_json(r, {}, f"round {i + 1}")["results"] for i, r in enumerate(rounds)]
        args.json.write_text(json.dumps(data, indent=2))
        log(f"raw numbers written to {args.json}")
    return 0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
