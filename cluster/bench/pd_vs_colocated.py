"""Colocated LLM replicas against a prefill + a decode replica (E/P/D), and vLLM 0.32 beside them, under
one mixed load: ``python -m cluster.bench.pd_vs_colocated``.

Equal resources: ``colocated`` is ``mmserve serve`` with two LLM replicas of role ``both``; ``pd`` is
``mmserve serve`` with one ``prefill`` and one ``decode`` replica (``llm.pools``); every LLM replica
runs its model on one torch thread (``llm.torch_threads: 1``), and both have the same encoder pool and
ingress. ``vllm`` is ``vllm serve`` of the same directory (the peer venv: shared/tools/peer_vllm),
colocated by construction. One server after the other, on the same machine, in one run.

``--pin``: the same, with each LLM replica on a core of its own (``deployment.cpu_affinity``,
cluster/cpu_affinity.py): ``colocated``'s two replicas on the first and the second of ``--pin-cores``
(``"0|1"``: each replica claims a set), ``pd``'s prefill replica on the first and its decode replica on
the second. The encoder and the ingress are the same in both: not pinned (the OS places them on any
core), or both on ``--others-cores``. vLLM is not pinned (one engine process). The table's header says
which cores each replica reported (its ``cpu_affinity`` in ``/stats?pools=true``).

The load (``cluster.bench.mixed_load``): long multimodal prompts (4 distinct images and a paragraph)
arriving at random among short-prompt long-output text requests, sent by the project's ``openai``
client as an open loop. Per server: decode ITL p50/p99 (every gap between streamed tokens), TTFT
p50/p99 per kind, goodput (requests per second that meet the SLO: ``mixed_load.SLO``), CPU-ms per
request of every process of the server, and for ``pd`` the KV transfer from the replicas' own
counters (``kv_*`` of ``/stats?pools=true``): MB moved and CPU-ms per handed-off request (the prefill
replica reading the blocks out, the decode replica writing them in). The last table gives ``pd`` over
``colocated`` (the targets of issue 48: ITL p99 ≤ 0.5×, goodput ≥ 1.3×).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

from cluster.bench.cpu_profile import process_costs
from cluster.bench.mixed_load import SLO, MixedLoad, MixedSummary, run_mixed, summarize_mixed
from cluster.bench.pd_report import kv_transfer, render, replica_cores
from cluster.bench.procs import CLOCK_TICKS_PER_S
from cluster.bench.servers import ServerProcess, pool_stats
from cluster.bench.vs_vllm import vllm_server

REPO = Path(__file__).resolve().parents[2]
SERVERS = ("colocated", "pd", "vllm")


def mmserve_config(args: argparse.Namespace, pd: bool) -> str:
    """The ``AppConfig`` YAML of a ``colocated`` (2 replicas, role both) or ``pd`` (1 + 1) server;
    ``--pin``: each LLM replica on its own core, the encoder and ingress on ``--others-cores`` or not pinned."""
    first, second = pin_cores(args) if args.pin else (None, None)
    llm: dict[str, object] = {"torch_threads": 1}
    if pd:
        llm["pools"] = [
            {"role": role, "deployment": _pinned({"num_replicas": 1}, core)}
            for role, core in (("prefill", first), ("decode", second))
        ]
    else:
        llm["deployment"] = _pinned({"num_replicas": 2}, None if first is None else f"{first}|{second}")
    model: dict[str, object] = {"name": args.served_name, "path": str(args.model_dir), "llm": llm}
    config: dict[str, object] = {"models": [model]}
    if args.pin and args.others_cores is not None:
        model["encoder"] = {"deployment": {"cpu_affinity": args.others_cores}}
    ingress = args.ingress_cores if args.ingress_cores is not None else args.others_cores
    if args.pin and ingress is not None:
        config["ingress"] = {"deployment": {"cpu_affinity": ingress}}
    return json.dumps(config)  # YAML reads JSON


def pin_cores(args: argparse.Namespace) -> tuple[str, str]:
    """``--pin-cores A,B``: colocated replica 1 / the prefill replica on A, replica 2 / decode on B."""
    cores = [c.strip() for c in args.pin_cores.split(",") if c.strip()]
    if len(cores) != 2 or not all(c.isdigit() for c in cores) or cores[0] == cores[1]:
        raise SystemExit(f"--pin-cores: two distinct core numbers A,B, got {args.pin_cores!r}")
    return cores[0], cores[1]


def _pinned(deployment: dict[str, object], cores: str | None) -> dict[str, object]:
    return deployment if cores is None else {**deployment, "cpu_affinity": cores}


def mmserve_server(args: argparse.Namespace, name: str, port: int) -> ServerProcess:
    config = args.out_dir / f"{name}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(mmserve_config(args, pd=name == "pd"))
    argv = [sys.executable, "-m", "cluster.cli", "serve", "--config", str(config)]
    argv += ["--host", "127.0.0.1", "--port", str(port), *args.mmserve_args.split()]
    # a loaded host may take Ray's node past its default 60 s registration wait
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_raylet_start_wait_time_s": "180"}
    return ServerProcess(name, argv, port, args.out_dir / f"{name}-serve.log", env=env, cwd=args.mmserve_root)


def make_server(args: argparse.Namespace, key: str) -> ServerProcess:
    if key == "vllm":
        server = vllm_server(args)
        # the load's most: vLLM then profiles its encoder budget on 4 images, not a video of the
        # largest size (minutes through this preset's tower on one loaded CPU)
        server.argv += ["--limit-mm-per-prompt", json.dumps({"image": 4, "video": 0})]
        return server
    return mmserve_server(args, key, args.colocated_port if key == "colocated" else args.pd_port)


def run_server(
    args: argparse.Namespace, server: ServerProcess, load: MixedLoad, slo: SLO
) -> dict[str, object]:
    """Start, warm up (a small load of other images), measure the load, stop."""
    log(f"starting {server.name}: {server.describe()}")
    try:
        server.start()
        log(f"{server.name} healthy after {server.wait_healthy(args.startup_timeout):.0f} s")
        warm = MixedLoad(
            load.model, long_count=2, long_rate=2.0, short_count=4, short_rate=4.0, short_max_tokens=8
        )
        asyncio.run(run_mixed(server.base_url + "/v1", warm, run="warm-up"))
        stats_before, cpu_before = pool_stats(server.base_url), server.snapshot()
        load_before = os.getloadavg()[0]
        results, wall_s = asyncio.run(run_mixed(server.base_url + "/v1", load, run="measured"))
        cpu_after, stats_after = server.snapshot(), pool_stats(server.base_url)
        host_load = (load_before, os.getloadavg()[0])  # the host's 1-min load average around the load
    finally:
        server.stop()
        left = server.leftovers()
        log(f"{server.name} stopped" + (f"; still alive: {left}" if left else ""))
    summary: MixedSummary = summarize_mixed(results, wall_s, slo)
    costs = process_costs(cpu_before, cpu_after, CLOCK_TICKS_PER_S)
    errors = sorted({r.error or "" for r in results if not r.ok})[:3]
    log(
        f"{server.name}: {summary.completed} ok, {summary.failed} failed {errors}; goodput {summary.goodput:.2f}/s"
    )
    return {
        "server": server.name,
        "summary": summary.as_dict(),
        "cpu_ms_per_request": sum(c.cpu_ms for c in costs) / max(1, summary.completed),
        "kv": kv_transfer(stats_before, stats_after),
        "cores": replica_cores(stats_after),
        "host_load": host_load,
        "errors": errors,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m cluster.bench.pd_vs_colocated", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/pdbench/epd-qwen2-vl"))
    p.add_argument("--served-name", default="epd-qwen2-vl")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"which, in order: {', '.join(SERVERS)}")
    p.add_argument("--mmserve-root", type=Path, default=REPO, help="checkout whose `cluster.cli serve` runs")
    p.add_argument("--mmserve-args", default="", help="more `mmserve serve` flags for both mmserve servers")
    p.add_argument("--peer-dir", type=Path, default=REPO.parent / "shared/tools/peer_vllm")
    p.add_argument("--vllm-venv", type=Path, default=Path("/tmp/peer_vllm/venv"))
    p.add_argument(
        "--pin",
        action="store_true",
        help="each LLM replica on a core of its own (colocated: one per replica; pd: prefill, decode)",
    )
    p.add_argument("--pin-cores", default="0,1", help="--pin: the two LLM cores, A,B")
    p.add_argument(
        "--others-cores",
        default=None,
        help="--pin: the encoder's and the ingress's cpu_affinity (e.g. 0); default: not pinned",
    )
    p.add_argument(
        "--ingress-cores",
        default=None,
        help="--pin: the ingress's cpu_affinity alone (e.g. 1: beside the decode replica, whose tokens it "
        "relays); default: --others-cores",
    )
    p.add_argument("--colocated-port", type=int, default=8731)
    p.add_argument("--pd-port", type=int, default=8732)
    p.add_argument("--vllm-port", type=int, default=8733)
    d = MixedLoad(model="")
    p.add_argument("--long-count", type=int, default=d.long_count)
    p.add_argument("--long-rate", type=float, default=d.long_rate, help="long requests per second")
    p.add_argument("--long-images", type=int, default=d.long_images)
    p.add_argument("--image-size", type=int, default=d.image_size)
    p.add_argument("--long-words", type=int, default=d.long_words)
    p.add_argument("--long-max-tokens", type=int, default=d.long_max_tokens)
    p.add_argument("--short-count", type=int, default=d.short_count)
    p.add_argument("--short-rate", type=float, default=d.short_rate, help="short requests per second")
    p.add_argument("--short-max-tokens", type=int, default=d.short_max_tokens)
    p.add_argument("--seed", type=int, default=d.seed)
    s = SLO()
    p.add_argument("--slo-ttft-long-ms", type=float, default=s.ttft_long_s * 1000)
    p.add_argument("--slo-ttft-short-ms", type=float, default=s.ttft_short_s * 1000)
    p.add_argument("--slo-max-itl-ms", type=float, default=s.max_itl_s * 1000)
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--out-dir", type=Path, default=Path("/tmp/bench_pd") / time.strftime("%Y%m%d-%H%M%S"))
    p.add_argument("--json", type=Path, help="write every server's numbers here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (a runner started in the background ignores SIGINT) unwinds too: the server is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    order = [k.strip() for k in args.servers.split(",") if k.strip()]
    unknown = [k for k in order if k not in SERVERS]
    if unknown:
        raise SystemExit(f"--servers: unknown {unknown}; have {list(SERVERS)}")
    needs = [args.model_dir / "config.json"]
    if "vllm" in order:
        needs += [args.vllm_venv / "bin/python", args.peer_dir / "vllm_cli.py"]
    for need in needs:
        if not need.exists():
            raise SystemExit(
                f"{need} is missing (docs/disaggregation.md: how to make the model and the peer venv)"
            )
    load = MixedLoad(
        args.served_name,
        long_count=args.long_count,
        long_rate=args.long_rate,
        long_images=args.long_images,
        image_size=args.image_size,
        long_words=args.long_words,
        long_max_tokens=args.long_max_tokens,
        short_count=args.short_count,
        short_rate=args.short_rate,
        short_max_tokens=args.short_max_tokens,
        seed=args.seed,
    )
    slo = SLO(args.slo_ttft_long_ms / 1000, args.slo_ttft_short_ms / 1000, args.slo_max_itl_ms / 1000)
    load_avg = os.getloadavg()[0]
    rows: list[dict[str, object]] = []
    failed: list[str] = []
    for key in order:  # a server that fails to start or serve is named; the others still run
        try:
            rows.append(run_server(args, make_server(args, key), load, slo))
        except RuntimeError as e:
            log(f"{key} failed: {e}")
            failed.append(f"{key}: {str(e).splitlines()[0]}")
    pinned = (
        f"pinned: LLM replicas on cores {args.pin_cores} (colocated one each, pd prefill then decode), encoder "
        f"{'on ' + args.others_cores if args.others_cores else 'not pinned'}, ingress "
        f"{'on ' + ing if (ing := args.ingress_cores or args.others_cores) else 'not pinned'}"
        if args.pin
        else "not pinned"
    )
    header = (
        f"model_dir={args.model_dir}; {pinned}; load: {load.describe()}; SLO: {slo.describe()}; cores={os.cpu_count()}, "
        f"load average at start {load_avg:.2f}, at end {os.getloadavg()[0]:.2f}"
    )
    if failed:
        header += "; not measured: " + "; ".join(failed)
    print(render(rows, header), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"header": header, "rows": rows}, indent=2, default=str))
        log(f"raw numbers written to {args.json}")
    return 1 if failed else 0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
