"""vLLM's load client, ``vllm bench serve``, as the benchmarks run it: its command line for one load
(random or random-mm, the same lengths, seed and percentiles for every server) and the environment
the peer venv's processes get (offline, no usage stats, tcmalloc where vLLM's CPU docs ask for it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cluster.bench.vs_report import Load

BUCKETS = "{(64, 64, 1): 0.25, (112, 112, 1): 0.25, (168, 168, 1): 0.25, (224, 224, 1): 0.25}"
QUIET_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def bench_argv(args: argparse.Namespace, load: Load, base_url: str, seed: int, result: Path) -> list[str]:
    """``vllm bench serve`` as ``run_bench_against.sh`` of the peer folder runs it, for one load."""
    argv = [str(args.vllm_venv / "bin/python"), str(args.peer_dir / "vllm_cli.py"), "bench", "serve"]
    argv += ["--backend", "openai-chat", "--base-url", base_url, "--endpoint", "/v1/chat/completions"]
    argv += ["--model", args.served_name, "--tokenizer", str(args.model_dir), "--dataset-name", load.dataset]
    argv += ["--num-prompts", str(load.num_prompts), "--max-concurrency", str(load.concurrency)]
    argv += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    argv += ["--random-range-ratio", "0.0"]
    if load.dataset == "random-mm":
        argv += ["--random-mm-base-items-per-request", str(load.items)]
        argv += ["--random-mm-num-mm-items-range-ratio", "0"]
        argv += [
            "--random-mm-limit-mm-per-prompt",
            json.dumps({"image": load.items, "video": 0}),
            "--random-mm-bucket-config",
            BUCKETS,
        ]
    argv += [
        "--request-rate",
        str(load.request_rate),
        "--seed",
        str(seed),
        "--temperature",
        "0",
        "--num-warmups",
        "1",
        "--ignore-eos",
    ]
    body = load.extra_body or getattr(args, "extra_body", None)
    if body:  # e.g. a response_format on every request (docs/benchmarks.md)
        argv += ["--extra-body", body]
    argv += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"]
    argv += ["--ready-check-timeout-sec", "60", "--disable-tqdm", "--save-result"]
    argv += ["--result-dir", str(result.parent), "--result-filename", result.name]
    return argv
