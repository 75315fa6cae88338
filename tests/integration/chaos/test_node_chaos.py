"""Node loss, a kill during scale-up and a kill during overlap prefill, on a local two-node cluster
(``cluster/bench/chaos_node.py``: the same scenarios as its CLI). One cluster and app for the module;
the scenarios run once, in order, and each test reads its own row: 64 image requests at c=8, every one
``ok`` or failed with a coded error within its deadline (0 uncoded, 0 lost), the pools back at their
target sizes, and nothing held after (running or waiting requests, KV blocks, cache reservations,
named actors beyond the app's own)."""

from __future__ import annotations

import asyncio

import pytest

from cluster.bench import chaos_node
from cluster.bench.chaos_outcomes import CODED, LOST, OK, UNCODED, ScenarioReport
from tests.integration.local_app import free_port

pytestmark = pytest.mark.chaos


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ScenarioReport]:
    port = free_port()
    args = chaos_node.parse_args(
        ["--port", str(port), "--models-dir", str(tmp_path_factory.mktemp("models"))]
    )
    with chaos_node.chaos_cluster(args.port, args.models_dir) as cc:
        done = asyncio.run(chaos_node.run_all(cc, args))
    print("\n" + chaos_node.render(done))
    return {r.scenario: r for r in done}


def _check(r: ScenarioReport) -> None:
    assert r.sent == 64
    assert r.counts[UNCODED] == 0 and r.counts[LOST] == 0, r.notes
    assert r.counts[OK] + r.counts[CODED] == 64
    assert r.full_capacity_s is not None, f"{r.scenario}: the pools never came back to their targets"
    assert r.leak_count == 0, r.leaks


def test_encoder_killed_while_a_requests_items_are_still_arriving(reports: dict[str, ScenarioReport]) -> None:
    r = reports["overlap-kill"]
    assert r.in_flight_at_fault > 0, r.notes  # the kill came while the LLM held requests
    _check(r)


def test_encoder_killed_while_its_pool_scales_up(reports: dict[str, ScenarioReport]) -> None:
    r = reports["scale-up-kill"]
    assert r.in_flight_at_fault > 0, r.notes  # the pool was scaling: the kill came
    _check(r)


def test_a_whole_node_lost_and_a_new_one_started(reports: dict[str, ScenarioReport]) -> None:
    r = reports["node-loss"]
    assert r.in_flight_at_fault > 0, r.notes
    _check(r)
