"""What the multi-node chaos benchmarks share (``chaos_node.py``, ``chaos_pd.py``): the local cluster
(``ray.cluster_utils.Cluster``: the head and node A) with the app started on it, the app's common
part (the ingress on the head, the encoder pool and its cache shard on node A), the leak read after a
scenario, the command line and the run of every scenario in turn."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster.bench.chaos_load import at_capacity, held, named_actor_leaks, wait_until, wanted
from cluster.bench.chaos_outcomes import HEADERS, ScenarioReport, row
from cluster.bench.stats import markdown_table

if TYPE_CHECKING:
    from ray._private.node import Node
    from ray.cluster_utils import Cluster

VL = "tiny-qwen2-vl"
SHARDS = 1


@dataclass
class ChaosCluster:
    """The cluster and this driver's connection to it; ``node`` is node A (replaced by node-loss)."""

    cluster: Cluster
    node: Node
    base_url: str


@contextlib.contextmanager
def chaos_cluster(port: int, config: dict[str, Any], worker: dict[str, float]) -> Iterator[ChaosCluster]:
    """Start the cluster and the app ``config`` (node A with the ``worker`` markers); on the way out
    shut Serve, the driver and every node down."""
    import ray
    from ray import serve

    from cluster.config import AppConfig
    from cluster.serve_cli import start
    from cluster.serve_env import apply_serve_env

    apply_serve_env()  # read by the Serve processes each node starts
    head = {"num_cpus": 2, "resources": {"head_node": 1.0}, "include_dashboard": False}
    c = start_head(head)  # a failed start is shut down in there
    try:
        node = c.add_node(num_cpus=2, resources=worker)
        c.wait_for_nodes()
        ray.init(address=c.address, namespace="mmserve")
        start(AppConfig.model_validate(config))
        yield ChaosCluster(c, node, f"http://127.0.0.1:{port}/v1")
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        with contextlib.suppress(Exception):
            ray.shutdown()
        c.shutdown()


def start_head(head: dict[str, Any], tries: int = 3) -> Cluster:
    """A cluster with its first node, the head, started; a start that times out (Ray waits 30 s for
    the raylet to register, which a busy machine can miss) is shut down and tried again."""
    from ray.cluster_utils import Cluster

    for attempt in range(1, tries + 1):
        c = Cluster(initialize_head=False)
        try:
            c.add_node(**head)
            return c
        except Exception as e:
            c.shutdown()
            if "timed out during startup" not in str(e) or attempt == tries:
                raise
            _log(f"the head's start timed out (try {attempt} of {tries}): starting it again")
    raise AssertionError("unreachable: the last try returns or raises")


def app_config(port: int, cache_dir: str, encoder: dict[str, Any], **model: Any) -> dict[str, Any]:
    """The app of a scenario: the ingress on the head, the tiny Qwen2-VL's encoder pool (``encoder``:
    its Serve options) and cache shard on node A, the model's other sections (``llm``, ``preprocess``)
    as given."""
    return {
        "host": "127.0.0.1",
        "port": port,
        "models_cache_dir": cache_dir,
        "ingress": {
            "http_mode": "direct",
            "deployment": {"num_replicas": 1, "num_cpus": 0.1, "resources": {"head_node": 0.01}},
        },
        "models": [
            {
                "name": VL,
                "tiny": "qwen2-vl",
                "encoder": {
                    "device": "cpu",
                    "cache_index_shards": SHARDS,
                    "cache_index_resources": {"encoder_node": 0.01},
                    "deployment": {**encoder, "resources": {"encoder_node": 0.01}},
                },
                **model,
            }
        ],
    }


def settle_and_read_leaks(
    targets: dict[str, int], timeout_s: float, llm_pools: tuple[str, ...] = ("LLMServer",)
) -> dict[str, object]:
    """Wait for the pools to settle (each back at exactly its target, scaled down) and the books to
    empty, then read what is still held (``llm_pools``: the LLM deployments' class names to read)."""
    from cluster.cache_shards import cache_index_args
    from cluster.config import ModelConfig

    args = cache_index_args(ModelConfig(name=VL, tiny="qwen2-vl", encoder={"cache_index_shards": SHARDS}))

    def empty() -> bool:
        exact = all(wanted(d) == n for d, n in targets.items())
        return exact and at_capacity(targets) and not any(held(VL, args, llm_pools=llm_pools).values())

    wait_until(empty, timeout_s, 1.0)
    found: dict[str, object] = dict(held(VL, args, llm_pools=llm_pools))
    found["named_actors"] = named_actor_leaks({VL: SHARDS})
    return found


def argument_parser(prog: str, doc: str, scenarios: tuple[str, ...], port: int) -> argparse.ArgumentParser:
    """The options every chaos benchmark takes; ``parse_scenarios`` reads them."""
    p = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc.split("\n\n")[0])
    p.add_argument("--scenarios", default=",".join(scenarios), help=f"comma list of {scenarios}")
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--deadline-s", type=float, default=240.0, help="a request open longer is lost")
    p.add_argument("--recover-timeout-s", type=float, default=300.0)
    p.add_argument(
        "--settle-timeout-s", type=float, default=180.0, help="> the cache's 60 s evict grace + a sweep"
    )
    p.add_argument("--models-dir", default=os.path.expanduser("~/.cache/mmserve/models"))
    return p


def parse_scenarios(
    p: argparse.ArgumentParser, scenarios: tuple[str, ...], argv: list[str] | None
) -> argparse.Namespace:
    args = p.parse_args(argv)
    args.scenario_list = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    for s in args.scenario_list:
        if s not in scenarios:
            p.error(f"--scenarios: unknown {s!r}; one of {scenarios}")
    return args


Scenario = Callable[[str, ChaosCluster, argparse.Namespace], Awaitable[ScenarioReport]]


async def run_all(
    cc: ChaosCluster, args: argparse.Namespace, scenario: Scenario, log: Callable[[str], None]
) -> list[ScenarioReport]:
    """Every scenario in turn; Serve is shut down on the loop its handles live on (after the loop,
    their long-poll threads find it closed and Ray's exit hangs)."""
    from ray import serve

    reports = []
    try:
        for name in args.scenario_list:
            reports.append(await scenario(name, cc, args))
            log(f"{name}: {row(reports[-1])}")
    finally:
        await serve.shutdown_async()
    return reports


def render(reports: list[ScenarioReport]) -> str:
    out = [markdown_table(HEADERS, [row(r) for r in reports])]
    out += [f"- {r.scenario}: {n}" for r in reports for n in r.notes]
    return "\n".join(out)


def exit_code(reports: list[ScenarioReport]) -> int:
    """1 if any request ended uncoded or lost, or anything leaked."""
    bad = [r for r in reports if r.counts["uncoded"] or r.counts["lost"] or r.leak_count]
    return 1 if bad else 0


def logger(name: str) -> Callable[[str], None]:
    def log(msg: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    return log


_log = logger("chaos-cluster")
