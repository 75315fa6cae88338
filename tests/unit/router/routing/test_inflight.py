"""The router's own in-flight counts and a late replica report (router/routing/inflight.py)."""

from __future__ import annotations

from router.routing.inflight import InFlight


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_late_report_does_not_count_this_routers_finished_calls() -> None:
    clock = Clock()
    own = InFlight(clock=clock)
    for i in range(6):
        own.add(f"r{i}", "A", 1.0)
    clock.now = 101.0
    reported_at = 101.0  # the replica reported 6 running: all of them this router's
    clock.now = 102.0
    for i in range(6):
        own.done(f"r{i}")
    # the report arrives after the burst: the replica is idle, as far as anyone knows
    assert own.load("A", reported=6.0, reported_at=reported_at) == 0.0
    # the old rule kept it busy until the next report
    assert max(6.0, own.by_replica.get("A", 0.0)) == 6.0


def test_other_callers_share_of_a_report_is_added_to_the_own_count() -> None:
    clock = Clock()
    own = InFlight(clock=clock)
    own.add("a", "A", 1.0)
    own.add("b", "A", 1.0)
    clock.now = 101.0
    # the replica runs 5 at 101.5: 2 of this router's, 3 of another ingress's
    own.add("c", "A", 1.0)
    clock.now = 102.0
    assert own.load("A", reported=5.0, reported_at=100.5) == 3.0 + 3.0
    own.done("a")
    assert own.load("A", reported=5.0, reported_at=100.5) == 3.0 + 2.0


def test_an_unstamped_report_is_taken_as_it_is() -> None:
    own = InFlight(clock=Clock())
    own.add("a", "A", 1.0)
    assert own.load("A", reported=4.0, reported_at=None) == 4.0
    assert own.load("B", reported=0.0, reported_at=None) == 0.0
    assert own.load("A", reported=0.0, reported_at=None) == 1.0


def test_history_is_bounded_by_the_horizon_and_keeps_the_amount_in_force() -> None:
    clock = Clock()
    own = InFlight(horizon_s=10.0, clock=clock)
    own.add("a", "A", 1.0)
    for i in range(1000):
        clock.now += 1.0
        own.add(f"x{i}", "A", 1.0)
        own.done(f"x{i}")
    assert len(own._history["A"]) <= 2 * 10 + 2
    assert own.at("A", clock.now - 5.5) == 1.0  # between an add and its done: 1 + 1 - 1
    own.forget("A")
    assert own.load("A", reported=2.0, reported_at=clock.now) == 2.0


def test_amounts_never_go_negative_and_unknown_requests_are_ignored() -> None:
    own = InFlight(clock=Clock())
    own.done("never")
    own.add("a", "A", 2.5)
    own.done("a")
    own.done("a")
    assert own.by_replica["A"] == 0.0
    assert own.load("A", reported=1.0, reported_at=50.0) == 1.0
