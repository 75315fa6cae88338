"""E/P/D's prefill replica and, separately, its decode replica SIGKILLed under load
(``cluster/bench/chaos_pd.py``: the same scenarios as its CLI). One two-node cluster and app for the
module; each scenario sends 64 image requests at c=8 and strikes while the pool's replica holds
requests (handoff-kill: while the prefill replica holds hand-offs the decode replica, stopped, has
not pulled): every request ``ok`` or failed with a coded error within its deadline (0 uncoded, 0 lost),
the pools back at their targets, and nothing held after (requests and KV blocks on both LLM pools,
the prefill side's hand-off pins, encoder-cache reservations, refs, named actors)."""

from __future__ import annotations

import asyncio

import pytest

from cluster.bench import chaos_pd
from cluster.bench.chaos_node import chaos_cluster, render
from cluster.bench.chaos_outcomes import CODED, LOST, OK, UNCODED, ScenarioReport
from tests.integration.local_app import free_port

pytestmark = pytest.mark.chaos


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ScenarioReport]:
    port = free_port()
    args = chaos_pd.parse_args(["--port", str(port), "--models-dir", str(tmp_path_factory.mktemp("models"))])
    config = chaos_pd.app_config(args.port, args.models_dir)
    with chaos_cluster(args.port, args.models_dir, config=config, worker=chaos_pd.WORKER) as cc:
        done = asyncio.run(chaos_pd.run_all(cc, args))
    print("\n" + render(done))
    return {r.scenario: r for r in done}


def _check(r: ScenarioReport) -> None:
    assert r.in_flight_at_fault > 0, r.notes  # the kill came while requests were open
    assert r.sent == 64
    assert r.counts[UNCODED] == 0 and r.counts[LOST] == 0, r.notes
    assert r.counts[OK] + r.counts[CODED] == 64
    assert set(r.codes) <= {"kv_transfer_failed", "replica_lost", "llm_replica_lost", "overloaded"}, (
        r.codes
    )  # retryable
    assert r.full_capacity_s is not None, f"{r.scenario}: the pools never came back to their targets"
    assert r.leak_count == 0, r.leaks


def test_prefill_replica_killed_under_load(reports: dict[str, ScenarioReport]) -> None:
    _check(reports["prefill-kill"])


def test_decode_replica_killed_under_load(reports: dict[str, ScenarioReport]) -> None:
    _check(reports["decode-kill"])


def test_prefill_replica_killed_between_its_handoffs_and_their_pulls(
    reports: dict[str, ScenarioReport],
) -> None:
    _check(reports["handoff-kill"])
