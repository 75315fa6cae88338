"""``python -m cluster.bench.chaos_pd``: a prefill replica and, separately, a decode replica SIGKILLed
under load on an E/P/D app (docs/disaggregation.md).

The local two-node cluster of ``chaos_node.py`` (``ray.cluster_utils.Cluster``: the head with the
ingress and the Serve controller; node A with the encoder, prefill and decode pools and the cache
shard), the tiny Qwen2-VL with ``llm.pools`` (one prefill and one decode replica). Each scenario sends
``--requests`` streamed image requests at ``--concurrency`` with the ``openai`` client, each under
``--deadline-s``, and strikes once the load is under way:

  prefill-kill   SIGKILL the prefill replica while it holds requests (prompts computing, hand-offs
                 pinned for their pulls): those are prefilled again on its successor, a pull from it
                 fails (``kv_transfer_failed``: the decode replica frees its blocks) and is prefilled
                 again
  decode-kill    SIGKILL the decode replica while it runs requests: one before its first output is
                 prefilled again and sent to the successor; one past it fails with a coded 503
  handoff-kill   SIGKILL the prefill replica between its hand-offs and their pulls: the decode
                 replica is stopped (SIGSTOP, under the links' 3 s heartbeat) until the prefill
                 replica holds pinned hand-offs, the prefill replica is killed, the decode replica
                 continued (SIGCONT): its pulls from the dead replica fail, it frees the blocks it
                 reserved, and the ingress prefills those requests again on the successor

Every request ends ``ok``, ``coded``, ``uncoded`` or ``lost`` (``chaos_outcomes.py``); the table prints
the counts, the codes, the seconds until the pools are back at their targets, and what is still held
after the run (running or waiting requests and KV blocks on both LLM pools, the prefill side's
hand-off pins, encoder-cache reservations, embedding refs, named actors beyond the app's own).
``tests/integration/chaos/test_pd_chaos.py`` asserts 0 uncoded, 0 lost, 0 leaks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from typing import Any

from cluster.bench import chaos_cluster as common
from cluster.bench.chaos_cluster import VL, ChaosCluster, chaos_cluster, render
from cluster.bench.chaos_load import (
    Load,
    at_capacity,
    image_specs,
    kill_replica,
    replica_names,
    replica_pid,
    wait_until,
)
from cluster.bench.chaos_outcomes import OK, ScenarioReport, report

ENC, PREFILL, DECODE = f"EncoderServer-{VL}", f"LLMPrefillServer-{VL}", f"LLMDecodeServer-{VL}"
TARGETS = {ENC: 1, PREFILL: 1, DECODE: 1, "IngressServer": 1, f"EncoderCacheIndex-{VL}": 1}
WORKER = {"encoder_node": 1.0, "prefill_node": 1.0, "decode_node": 1.0}
SCENARIOS = ("prefill-kill", "decode-kill", "handoff-kill")
VICTIM = {"prefill-kill": PREFILL, "decode-kill": DECODE}
PAUSE_S = 2.0  # the longest the decode replica stays stopped: under the links' 3 s heartbeat timeout


def app_config(
    port: int,
    cache_dir: str,
    handoff_deadline_s: float = 30.0,
    kv_pull_chunks: bool = False,
    kv_transfer: str = "link",
) -> dict[str, Any]:
    """The app of the scenarios: the ingress on the head, every pool one replica on node A;
    ``kv_pull_chunks``: the pulls overlap the prefill, chunk by chunk (early hand-offs);
    ``kv_transfer``: ``collective``, the KV on a gloo pair group (llm_service/serve/kv_pair.py)."""
    one = {"num_replicas": 1, "num_cpus": 0.2}
    return common.app_config(
        port,
        cache_dir,
        one,
        llm={
            "device": "cpu",
            "num_kv_blocks": 512,
            "handoff_deadline_s": handoff_deadline_s,
            "kv_transfer_timeout_s": 10.0,
            "kv_pull_chunks": kv_pull_chunks,
            "kv_transfer": kv_transfer,
            "pools": [
                {"role": "prefill", "deployment": {**one, "resources": {"prefill_node": 0.01}}},
                {"role": "decode", "deployment": {**one, "resources": {"decode_node": 0.01}}},
            ],
        },
    )


def pool_stats(deployment: str) -> dict[str, Any]:
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name="mmserve")
    return dict(handle.stats.remote().result(timeout_s=10))


def busy(deployment: str, s: dict[str, Any]) -> int:
    """What the replica holds that a kill strikes: requests running or waiting, and (prefill) pins."""
    return int(s["num_running"]) + int(s["num_waiting"]) + int(s.get("kv_pins_held", 0))


async def strike(load: Load, deployment: str, least: int) -> tuple[set[str], list[str], float | None]:
    """SIGKILL the pool's replica once it holds ``least`` requests (after 8 were sent)."""
    await load.wait_started(8)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120 and load.started < len(load.specs):
        s = await asyncio.to_thread(pool_stats, deployment)
        if busy(deployment, s) >= least:
            at = time.monotonic()
            victim = await asyncio.to_thread(kill_replica, deployment)
            what = f"{s['num_running']} running, {s['num_waiting']} waiting"
            if "kv_pins_held" in s:
                what += f", {s['kv_pins_held']} hand-offs pinned"
            return {victim}, [f"killed {deployment.split('-')[0]} holding {what}"], at
        await asyncio.sleep(0.02)
    return set(), [f"the moment never came: {deployment} never held {least} requests"], None


async def strike_between_handoff_and_pull(load: Load) -> tuple[set[str], list[str], float | None]:
    """Stop the decode replica until the prefill replica pins hand-offs no one pulls, kill the prefill
    replica, continue the decode replica; tried again (after a second of load) until it lands."""
    await load.wait_started(8)
    decode_pid = await asyncio.to_thread(replica_pid, (await asyncio.to_thread(replica_names, DECODE))[0])
    victim = (await asyncio.to_thread(replica_names, PREFILL))[0]
    prefill_pid = await asyncio.to_thread(replica_pid, victim)  # asked before: the kill is instant
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120 and load.started < len(load.specs):
        os.kill(decode_pid, signal.SIGSTOP)
        stopped, s = time.monotonic(), None
        try:
            while time.monotonic() - stopped < PAUSE_S - 0.3:
                s = await asyncio.to_thread(pool_stats, PREFILL)
                if s["kv_pins_held"] >= 2:
                    at = time.monotonic()
                    os.kill(prefill_pid, signal.SIGKILL)
                    note = (
                        f"killed LLMPrefillServer holding {s['kv_pins_held']} hand-offs pinned, unpulled "
                        f"(the decode replica stopped {at - stopped:.1f} s)"
                    )
                    return {victim}, [note], at
                await asyncio.sleep(0.02)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(decode_pid, signal.SIGCONT)
        await asyncio.sleep(1.0)
    return (
        set(),
        ["the moment never came: no two hand-offs pinned while the decode replica was stopped"],
        None,
    )


def back(victims: set[str], load: Load, fault_at: float | None) -> bool:
    """The killed replica's name is gone, every pool runs its target, and a request sent after the
    fault succeeded (Serve counts a dead replica RUNNING until its health check fails)."""
    names = set(replica_names(PREFILL)) | set(replica_names(DECODE))
    served = fault_at is None or any(o.verdict == OK and o.start > fault_at for o in list(load.outcomes))
    return served and not (victims & names) and at_capacity(TARGETS)


async def run_scenario(name: str, cc: ChaosCluster, args: argparse.Namespace) -> ScenarioReport:
    specs = image_specs(VL, args.requests, 1, 224, seed=sum(map(ord, name)))
    load = Load(cc.base_url, specs, args.concurrency, args.deadline_s, args.max_tokens)
    task = asyncio.create_task(load.run())
    if name == "handoff-kill":
        victims, notes, fault_at = await strike_between_handoff_and_pull(load)
    else:
        victims, notes, fault_at = await strike(load, VICTIM[name], 2)
    log(f"{name}: {'; '.join(notes)}")

    def recovered() -> bool:
        return back(victims, load, fault_at)

    capacity = asyncio.create_task(asyncio.to_thread(wait_until, recovered, args.recover_timeout_s, 0.5))
    outcomes = await task
    took = await capacity
    back_at = None if took is None else time.monotonic()
    full_s = None if back_at is None or fault_at is None else back_at - fault_at
    leaks = await asyncio.to_thread(settle_and_read_leaks, args.settle_timeout_s)
    return report(name, outcomes, fault_at, full_s, leaks, notes)


def settle_and_read_leaks(timeout_s: float) -> dict[str, object]:
    return common.settle_and_read_leaks(TARGETS, timeout_s, llm_pools=("LLMPrefillServer", "LLMDecodeServer"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.argument_parser("cluster.bench.chaos_pd", __doc__ or "", SCENARIOS, port=8473)
    p.add_argument("--max-tokens", type=int, default=24, help="long enough that decodes are in flight")
    p.add_argument(
        "--kv-pull-chunks",
        action="store_true",
        help="llm.kv_pull_chunks: early hand-offs, pulled chunk by chunk",
    )
    p.add_argument(
        "--kv-transfer",
        choices=["link", "collective"],
        default="link",
        help="llm.kv_transfer: the KV over the link, or on a gloo pair group",
    )
    return common.parse_scenarios(p, SCENARIOS, argv)


async def run_all(cc: ChaosCluster, args: argparse.Namespace) -> list[ScenarioReport]:
    return await common.run_all(cc, args, run_scenario, log)


log = common.logger("chaos-pd")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log("starting a 2-node cluster and the E/P/D app ...")
    config = app_config(
        args.port, args.models_dir, kv_pull_chunks=args.kv_pull_chunks, kv_transfer=args.kv_transfer
    )
    with chaos_cluster(args.port, config, WORKER) as cc:
        reports = asyncio.run(run_all(cc, args))
    print(render(reports), flush=True)
    return common.exit_code(reports)


if __name__ == "__main__":
    sys.exit(main())
