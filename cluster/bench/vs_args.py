"""The command line of ``python -m cluster.bench.vs_vllm`` (its flags, checked, and the loads they pick)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from cluster.bench.vs_report import Load, paired, select_loads

REPO = Path(__file__).resolve().parents[2]
DESCRIPTION = "mmserve against vLLM 0.32 (CPU), one server after the other, same model directory, same load from vLLM's own client: ``python -m cluster.bench.vs_vllm``."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cluster.bench.vs_vllm", description=DESCRIPTION)
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/peer_vllm/tiny-qwen2-vl"))
    p.add_argument("--served-name", default="tiny-qwen2-vl")
    p.add_argument("--peer-dir", type=Path, default=REPO.parent / "shared/tools/peer_vllm")
    p.add_argument("--vllm-venv", type=Path, default=Path("/tmp/peer_vllm/venv"))
    p.add_argument("--mmserve-root", type=Path, default=REPO, help="checkout whose `cluster.cli serve` runs")
    p.add_argument("--vllm-port", type=int, default=8711)
    p.add_argument("--mmserve-port", type=int, default=8712)
    p.add_argument(
        "--mmserve-baseline", type=Path, help="also run mmserve from this checkout, as `mmserve@baseline`"
    )
    p.add_argument("--baseline-port", type=int, default=8713)
    p.add_argument("--overlap-port", type=int, default=8716)
    p.add_argument(
        "--overlap-args",
        default="--overlap-prefill",
        help="`mmserve serve` flags of the `overlap` server (one flag alone needs `=`: "
        "--overlap-args=--overlap-prefill)",
    )
    p.add_argument("--mmserve-args", default="", help="more `mmserve serve` flags of the `mmserve` server")
    p.add_argument("--cluster-port", type=int, default=8714)
    p.add_argument("--cluster2-port", type=int, default=8715)
    p.add_argument(
        "--cluster-config",
        type=Path,
        default=REPO / "cluster/deploy/serve-cpu.yaml",
        help="what `serve deploy` gets",
    )
    p.add_argument(
        "--cluster-num-cpus",
        type=int,
        default=4,
        help="`ray start --num-cpus` of `cluster` (the README's 4); `cluster2` splits it between its two nodes",
    )
    p.add_argument(
        "--cluster-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="also set this where the clusters' `ray start` runs (repeatable), e.g. RAY_SERVE_ENABLE_HA_PROXY=1",
    )
    p.add_argument(
        "--servers",
        default="vllm,baseline,mmserve",
        help="which, in order (comma-separated): vllm, baseline (if given), mmserve, overlap (mmserve "
        "--overlap-prefill), cluster, cluster2",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        help="every load with this many requests instead (a quick check of the command)",
    )
    p.add_argument(
        "--extra-body",
        help="JSON merged into every request's body on every server (vllm bench serve --extra-body), e.g. "
        "a response_format with a JSON schema",
    )
    p.add_argument(
        "--paired-body",
        help="JSON: run every load twice on each server start, without and then with it merged into every "
        "request (e.g. a response_format): the with/without ratio (TPOT with a schema) from one run",
    )
    p.add_argument("--paired-label", default="schema", help="what the --paired-body twins are called")
    p.add_argument(
        "--paired-repeats",
        type=int,
        default=1,
        help="with --paired-body: this many pairs per load on each server start, every other one twin "
        "first; a table gives the twin/load ratio of TPOT, req/s and CPU-ms per request pair by pair",
    )
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--idle-seconds", type=float, default=5.0, help="idle background measured after the warm-up"
    )
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument(
        "--out-dir", type=Path, default=Path("/tmp/bench_vs_vllm") / time.strftime("%Y%m%d-%H%M%S")
    )
    p.add_argument("--json", type=Path, help="write every load's metrics and CPU profile here")
    p.add_argument(
        "--plots",
        type=Path,
        help="write latency.png (TTFT/ITL percentiles per server) and cpu.png (CPU-ms per request by "
        "process) here; default: --out-dir",
    )
    p.add_argument(
        "--loads",
        help="which loads, comma-separated (image-c32, image-c1, image4-c32: 4 distinct images per request, "
        "image4-c1, image4-c8, text-c32, image-rate30: 30 req/s "
        "arriving at random, open loop); default all",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every server this many times (every other round in the reverse order) and report, per "
        "server and load, the round with the median req/s; this host's noise is ±10 %% between runs",
    )
    args = p.parse_args(argv)
    for flag, body in (("--extra-body", args.extra_body), ("--paired-body", args.paired_body)):
        try:
            if body is not None:
                json.loads(body)
        except ValueError as e:
            p.error(f"{flag} is not JSON: {e}")
    try:
        args.loads = select_loads(args.loads)
    except ValueError as e:
        p.error(str(e))
    bad = [kv for kv in args.cluster_env if "=" not in kv]
    if bad:
        p.error(f"--cluster-env takes KEY=VALUE, got {bad}")
    if args.num_prompts is not None:
        args.loads = [resized(load, args.num_prompts) for load in args.loads]
    if args.paired_body is not None:
        args.loads = paired(args.loads, args.paired_body, args.paired_label, max(args.paired_repeats, 1))
    return args


def resized(load: Load, num_prompts: int) -> Load:
    """``load`` with ``num_prompts`` requests, named so (``image, 32 req, c=32``)."""
    name = load.name.replace(f"{load.num_prompts} req", f"{num_prompts} req")
    return replace(load, name=name, num_prompts=num_prompts)
