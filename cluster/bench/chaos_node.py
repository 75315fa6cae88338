"""``python -m cluster.bench.chaos_node``: whole-node loss, a kill during scale-up, a kill during overlap.

A local multi-node Ray cluster (``ray.cluster_utils.Cluster``: each node its own raylet, object store
and workers, as on a real cluster) runs the app with its pools pinned by node markers::

  head    (head_node)                  Serve controller, IngressServer (HTTP direct), cache owner
  node A  (encoder_node, llm_node)     EncoderServer, LLMServer, the model's cache-index shard

Each scenario sends ``--requests`` streamed image requests at ``--concurrency`` with the ``openai``
client, each under ``--deadline-s``, and strikes once the load is under way:

  overlap-kill    (overlap prefill on, 4 images a request) SIGKILL the encoder replica while the
                  LLM holds a request whose items are still queued on it
  scale-up-kill   (the encoder pool autoscales 1 -> 2 on a low target) SIGKILL the running encoder
                  replica while the second one is starting
  node-loss       SIGKILL every process of node A (raylet, its agents, every worker: the encoder and
                  LLM replicas and the cache shard), then start a new node with the same markers

Every request ends ``ok``, ``coded`` (an error naming its code), ``uncoded`` or ``lost`` (no answer
within its deadline: ``chaos_outcomes.py``); the table prints the counts, the codes, the seconds until
the pools are back at their target sizes, and what is still held after the run (running or waiting
requests, KV blocks, cache reservations, named actors beyond the app's own). Real Ray, real kills,
real HTTP: ``tests/integration/chaos/test_node_chaos.py`` asserts 0 uncoded, 0 lost, 0 leaks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster.bench.chaos_load import (
    Load,
    at_capacity,
    held,
    image_specs,
    kill_replica,
    named_actor_leaks,
    replica_names,
    running,
    wait_until,
    wanted,
)
from cluster.bench.chaos_outcomes import HEADERS, OK, ScenarioReport, report, row
from cluster.bench.procs import descendants, list_procs
from cluster.bench.stats import markdown_table

if TYPE_CHECKING:
    from ray._private.node import Node
    from ray.cluster_utils import Cluster

VL = "tiny-qwen2-vl"
ENC, LLM = f"EncoderServer-{VL}", f"LLMServer-{VL}"
TARGETS = {ENC: 1, LLM: 1, "IngressServer": 1, f"EncoderCacheIndex-{VL}": 1}
SHARDS = 1
WORKER = {"encoder_node": 1.0, "llm_node": 1.0}
SCENARIOS = ("overlap-kill", "scale-up-kill", "node-loss")


def app_config(port: int, cache_dir: str) -> dict[str, Any]:
    """The app of the scenarios: pools on node A, the ingress on the head, overlap prefill on, the
    encoder pool autoscaling 1..2 on a low queue target (8 requests of one image pass it)."""
    fast = {
        "upscale_delay_s": 1.0,
        "downscale_delay_s": 4.0,
        "look_back_period_s": 2.0,
        "metrics_interval_s": 0.5,
    }
    enc_policy = {
        "policy_function": "cluster.autoscaling_policy:EncoderQueuePolicy",
        "policy_kwargs": {
            "target_queued_embeddings_per_replica": 64,
            "embeddings_per_handle_queued_request": 64,
        },
    }
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
                "preprocess": {"overlap_prefill": True},
                "encoder": {
                    "device": "cpu",
                    "cache_index_shards": SHARDS,
                    "cache_index_resources": {"encoder_node": 0.01},
                    "deployment": {
                        "num_cpus": 0.2,
                        "resources": {"encoder_node": 0.01},
                        "autoscaling": {"min_replicas": 1, "max_replicas": 2, **fast, "policy": enc_policy},
                    },
                },
                "llm": {
                    "device": "cpu",
                    "num_kv_blocks": 512,
                    "deployment": {"num_replicas": 1, "num_cpus": 0.2, "resources": {"llm_node": 0.01}},
                },
            }
        ],
    }


@dataclass
class ChaosCluster:
    """The cluster and this driver's connection to it; ``node`` is node A (replaced by node-loss)."""

    cluster: Cluster
    node: Node
    base_url: str


@contextlib.contextmanager
def chaos_cluster(
    port: int, cache_dir: str, config: dict[str, Any] | None = None, worker: dict[str, float] | None = None
) -> Iterator[ChaosCluster]:
    """Start the cluster and the app (``config``: this module's ``app_config`` unless given; node A
    with the ``worker`` markers); on the way out shut Serve, the driver and every node down."""
    import ray
    from ray import serve

    from cluster.config import AppConfig
    from cluster.serve_cli import start
    from cluster.serve_env import apply_serve_env

    apply_serve_env()  # read by the Serve processes each node starts
    head = {"num_cpus": 2, "resources": {"head_node": 1.0}, "include_dashboard": False}
    c = start_head(head)  # a failed start is shut down in there
    try:
        node = c.add_node(num_cpus=2, resources=worker or WORKER)
        c.wait_for_nodes()
        ray.init(address=c.address, namespace="mmserve")
        start(AppConfig.model_validate(config or app_config(port, cache_dir)))
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
            log(f"the head's start timed out (try {attempt} of {tries}): starting it again")
    raise AssertionError("unreachable: the last try returns or raises")


def node_pids(node: Node) -> set[int]:
    """Every process of one node: the ones Ray started for it (raylet, agents, log monitor) and the
    raylet's descendants (its workers: replicas, actors)."""
    procs = list_procs()
    own = {p.process.pid for ps in node.all_processes.values() for p in ps if p.process is not None}
    below: set[int] = set()
    for pid in own:
        below |= descendants(procs, pid)
    return own | below


def kill_node(cc: ChaosCluster) -> int:
    """SIGKILL every process of node A at once (a cut power cord); returns how many. Ray's books of
    the node are then dropped (its processes are gone: nothing is left to stop)."""
    pids = node_pids(cc.node)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        cc.cluster.remove_node(cc.node, allow_graceful=False)
    return len(pids)


def shard_alive() -> bool:
    import ray

    shard = ray.get_actor(f"mmserve-encoder-cache-{VL}-0", namespace="mmserve")
    ray.get(shard.stats.remote(), timeout=5)
    return True


def back(victims: set[str], targets: dict[str, int], load: Load, fault_at: float | None) -> bool:
    """The killed replicas' names are gone, every pool runs its target with none starting, the shard
    answers, and a request sent after the fault has succeeded: Serve's status still counts a dead
    replica RUNNING until its health check fails, so its books alone would call the pool back at once."""
    names = set(replica_names(ENC)) | set(replica_names(LLM))
    served = fault_at is None or any(o.verdict == OK and o.start > fault_at for o in list(load.outcomes))
    return served and not (victims & names) and at_capacity(targets) and shard_alive()


async def watch_capacity(
    victims: set[str], targets: dict[str, int], load: Load, fault_at: float | None, timeout_s: float
) -> float | None:
    """The monotonic instant the app is ``back``, or None if not within ``timeout_s``."""
    took = await asyncio.to_thread(wait_until, lambda: back(victims, targets, load, fault_at), timeout_s, 0.5)
    return None if took is None else time.monotonic()


Strike = tuple[set[str], list[str], float | None]  # (the replicas killed, notes, when)


# -- the faults ------------------------------------------------------------------------------------


async def strike_overlap(load: Load) -> Strike:
    """Kill the encoder replica once the LLM holds a request and the encoder still has items queued."""
    from ray import serve

    enc = serve.get_deployment_handle(ENC, app_name="mmserve")
    llm = serve.get_deployment_handle(LLM, app_name="mmserve")

    def readings() -> tuple[dict[str, Any], dict[str, Any]]:
        return enc.stats.remote().result(timeout_s=10), llm.stats.remote().result(timeout_s=10)

    await load.wait_started(8)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120 and load.started < len(load.specs):
        e, s = await asyncio.to_thread(readings)
        if e["queued_items"] >= 2 and s["num_running"] + s["num_waiting"] >= 1:
            at = time.monotonic()
            rid = str(e["replica_id"])  # the replica whose FIFO holds the items: that one dies

            def holding(names: list[str], rid: str = rid) -> str:
                return next(n for n in names if n.endswith(f"#{rid}"))

            victim = await asyncio.to_thread(kill_replica, ENC, holding)
            others = len(await asyncio.to_thread(replica_names, ENC)) - 1
            held_by_llm = s["num_running"] + s["num_waiting"]
            note = (
                f"killed the replica with {e['queued_items']} items queued, {held_by_llm} requests on "
                f"the LLM, {others} other encoder replica(s) up"
            )
            return {victim}, [note], at
        await asyncio.sleep(0.05)
    return set(), ["the moment never came: no request held by the LLM with items queued"], None


async def strike_scale_up(load: Load) -> Strike:
    """Kill the running encoder replica while the pool's second replica is starting."""
    first = set(await asyncio.to_thread(replica_names, ENC))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 180 and load.started < len(load.specs):
        if await asyncio.to_thread(lambda: wanted(ENC) >= 2 and running(ENC) < 2):
            at = time.monotonic()
            victim = await asyncio.to_thread(kill_replica, ENC, lambda names: sorted(first & set(names))[0])
            return {victim}, [f"killed {victim.rsplit('#', 1)[-1]} while the pool scaled 1 -> 2"], at
        await asyncio.sleep(0.1)
    return set(), ["the pool never started scaling 1 -> 2 under the load"], None


async def strike_node(load: Load, cc: ChaosCluster, rejoin_after_s: float) -> Strike:
    """SIGKILL node A whole, then start a new node with the same markers ``rejoin_after_s`` later."""
    await load.wait_started(16)
    victims = set(await asyncio.to_thread(replica_names, ENC)) | set(
        await asyncio.to_thread(replica_names, LLM)
    )
    at = time.monotonic()
    n = kill_node(cc)
    await asyncio.sleep(rejoin_after_s)
    # On this thread: starting a node installs signal handlers (main thread only). Not waiting for
    # it to register keeps the load's loop running; the capacity watch sees it join.
    cc.node = cc.cluster.add_node(wait=False, num_cpus=2, resources=WORKER)
    return victims, [f"node A: {n} processes SIGKILLed; a new node started {rejoin_after_s:.0f} s later"], at


# -- one scenario ----------------------------------------------------------------------------------


async def run_scenario(name: str, cc: ChaosCluster, args: argparse.Namespace) -> ScenarioReport:
    images = {"overlap-kill": 4, "scale-up-kill": 2}.get(name, 1)
    size = 336 if name != "node-loss" else 224
    specs = image_specs(VL, args.requests, images, size, seed=sum(map(ord, name)))
    load = Load(cc.base_url, specs, args.concurrency, args.deadline_s, args.max_tokens)
    task = asyncio.create_task(load.run())
    if name == "overlap-kill":
        victims, notes, fault_at = await strike_overlap(load)
    elif name == "scale-up-kill":
        victims, notes, fault_at = await strike_scale_up(load)
    else:
        victims, notes, fault_at = await strike_node(load, cc, args.rejoin_after_s)
    log(f"{name}: {'; '.join(notes)}")
    capacity = asyncio.create_task(watch_capacity(victims, TARGETS, load, fault_at, args.recover_timeout_s))
    outcomes = await task
    back_at = await capacity
    full_s = None if back_at is None or fault_at is None else back_at - fault_at
    leaks = await asyncio.to_thread(settle_and_read_leaks, args.settle_timeout_s)
    return report(name, outcomes, fault_at, full_s, leaks, notes)


def settle_and_read_leaks(timeout_s: float) -> dict[str, object]:
    """Wait for the pools to settle and the books to empty, then read what is still held."""
    from cluster.cache_shards import cache_index_args
    from cluster.config import ModelConfig

    args = cache_index_args(ModelConfig(name=VL, tiny="qwen2-vl", encoder={"cache_index_shards": SHARDS}))

    def empty() -> bool:  # each pool back at exactly its target (scaled down), nothing held
        exact = all(wanted(d) == n for d, n in TARGETS.items())
        return exact and at_capacity(TARGETS) and not any(held(VL, args).values())

    wait_until(empty, timeout_s, 1.0)
    found: dict[str, object] = dict(held(VL, args))
    found["named_actors"] = named_actor_leaks({VL: SHARDS})
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m cluster.bench.chaos_node", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma list of {SCENARIOS}")
    p.add_argument("--port", type=int, default=8471)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--deadline-s", type=float, default=240.0, help="a request open longer is lost")
    p.add_argument("--rejoin-after-s", type=float, default=5.0, help="node-loss: when the new node starts")
    p.add_argument("--recover-timeout-s", type=float, default=300.0)
    p.add_argument(
        "--settle-timeout-s", type=float, default=180.0, help="> the cache's 60 s evict grace + a sweep"
    )
    p.add_argument("--models-dir", default=os.path.expanduser("~/.cache/mmserve/models"))
    args = p.parse_args(argv)
    args.scenario_list = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    for s in args.scenario_list:
        if s not in SCENARIOS:
            p.error(f"--scenarios: unknown {s!r}; one of {SCENARIOS}")
    return args


async def run_all(cc: ChaosCluster, args: argparse.Namespace) -> list[ScenarioReport]:
    """Every scenario in turn; Serve is shut down on the loop its handles live on (after the loop,
    their long-poll threads find it closed and Ray's exit hangs)."""
    from ray import serve

    reports = []
    try:
        for name in args.scenario_list:
            reports.append(await run_scenario(name, cc, args))
            log(f"{name}: {row(reports[-1])}")
    finally:
        await serve.shutdown_async()
    return reports


def render(reports: list[ScenarioReport]) -> str:
    out = [markdown_table(HEADERS, [row(r) for r in reports])]
    out += [f"- {r.scenario}: {n}" for r in reports for n in r.notes]
    return "\n".join(out)


def log(msg: str) -> None:
    print(f"[chaos-node {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log("starting a 2-node cluster and the app ...")
    with chaos_cluster(args.port, args.models_dir) as cc:
        reports = asyncio.run(run_all(cc, args))
    print(render(reports), flush=True)
    bad = [r for r in reports if r.counts["uncoded"] or r.counts["lost"] or r.leak_count]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
