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
from typing import TYPE_CHECKING, Any

from cluster.bench import chaos_cluster as common
from cluster.bench.chaos_cluster import VL, ChaosCluster, render, start_head
from cluster.bench.chaos_load import (
    Load,
    at_capacity,
    image_specs,
    kill_replica,
    replica_names,
    running,
    wait_until,
    wanted,
)
from cluster.bench.chaos_outcomes import OK, ScenarioReport, report
from cluster.bench.procs import descendants, list_procs

if TYPE_CHECKING:
    from ray._private.node import Node

__all__ = ["ChaosCluster", "chaos_cluster", "render", "start_head"]  # as before chaos_cluster.py

ENC, LLM = f"EncoderServer-{VL}", f"LLMServer-{VL}"
TARGETS = {ENC: 1, LLM: 1, "IngressServer": 1, f"EncoderCacheIndex-{VL}": 1}
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
    autoscaling = {"min_replicas": 1, "max_replicas": 2, **fast, "policy": enc_policy}
    return common.app_config(
        port,
        cache_dir,
        {"num_cpus": 0.2, "autoscaling": autoscaling},
        preprocess={"overlap_prefill": True},
        llm={
            "device": "cpu",
            "num_kv_blocks": 512,
            "deployment": {"num_replicas": 1, "num_cpus": 0.2, "resources": {"llm_node": 0.01}},
        },
    )


@contextlib.contextmanager
def chaos_cluster(
    port: int, cache_dir: str, config: dict[str, Any] | None = None, worker: dict[str, float] | None = None
) -> Iterator[ChaosCluster]:
    """``chaos_cluster.chaos_cluster`` with this module's app and node A's markers unless given."""
    with common.chaos_cluster(port, config or app_config(port, cache_dir), worker or WORKER) as cc:
        yield cc


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
    return common.settle_and_read_leaks(TARGETS, timeout_s)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.argument_parser("cluster.bench.chaos_node", __doc__ or "", SCENARIOS, port=8471)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--rejoin-after-s", type=float, default=5.0, help="node-loss: when the new node starts")
    return common.parse_scenarios(p, SCENARIOS, argv)


async def run_all(cc: ChaosCluster, args: argparse.Namespace) -> list[ScenarioReport]:
    return await common.run_all(cc, args, run_scenario, log)


log = common.logger("chaos-node")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log("starting a 2-node cluster and the app ...")
    with chaos_cluster(args.port, args.models_dir) as cc:
        reports = asyncio.run(run_all(cc, args))
    print(render(reports), flush=True)
    return common.exit_code(reports)


if __name__ == "__main__":
    sys.exit(main())
