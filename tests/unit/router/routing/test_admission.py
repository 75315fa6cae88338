"""router/routing/admission.py: bounded work in flight at the ingress, by count and by cost."""

from __future__ import annotations

import pytest

from router.protocol.errors import from_exception
from router.routing.admission import AdmissionController, AdmissionLimits, Overloaded


def _ctl(**kw: int) -> AdmissionController:
    return AdmissionController(AdmissionLimits(**kw))  # type: ignore[arg-type]


def test_cost_counts_media_by_modality_and_long_text() -> None:
    ctl = _ctl()
    assert ctl.cost([], 10) == 1
    assert ctl.cost(["image"] * 8, 10) == 1 + 8 * 4  # an 8-image request costs 33 text requests
    assert ctl.cost(["video", "audio"], 3 * 4096 + 5) == 1 + 16 + 4 + 3


def test_count_bound_refuses_at_once_and_release_reopens() -> None:
    ctl = _ctl(max_concurrent_requests=2, max_concurrent_cost=100)
    a, b = ctl.admit(1), ctl.admit(1)
    with pytest.raises(Overloaded) as e:
        ctl.admit(1)
    api = from_exception(e.value)
    assert api is not None and api.status_code == 503 and api.code == "overloaded"
    assert api.headers() == {"Retry-After": "1"}
    ctl.release(a)
    ctl.release(a)  # twice is once
    assert ctl.in_flight == 1
    ctl.admit(1)
    ctl.release(b)
    assert ctl.stats()["refused"] == 1 and ctl.stats()["admitted"] == 3


def test_cost_bound_refuses_a_costly_request_but_admits_a_cheap_one() -> None:
    ctl = _ctl(max_concurrent_requests=100, max_concurrent_cost=40)
    ctl.admit(ctl.cost(["image"] * 8, 0))  # 33
    with pytest.raises(Overloaded):
        ctl.admit(ctl.cost(["image"] * 2, 0))  # 9: 42 > 40
    ctl.admit(ctl.cost([], 0))  # text: 34
    assert ctl.cost_in_flight == 34


def test_a_request_costlier_than_the_budget_runs_alone() -> None:
    ctl = _ctl(max_concurrent_requests=10, max_concurrent_cost=10)
    big = ctl.admit(1000)  # clamped to the budget: admitted while nothing else runs
    with pytest.raises(Overloaded):
        ctl.admit(1)
    ctl.release(big)
    assert ctl.cost_in_flight == 0 and ctl.in_flight == 0


def test_closed_refuses_everything_but_takes_tickets_back() -> None:
    ctl = _ctl()
    t = ctl.admit(1)
    ctl.close()
    with pytest.raises(Overloaded) as e:
        ctl.admit(1)
    assert e.value.code == "shutting_down"
    ctl.release(t)
    assert ctl.in_flight == 0


def test_ray_and_serve_failures_map_to_retryable_503s() -> None:
    """Matched by class name in the MRO, as Ray's dual RayTaskError classes carry the cause's class."""

    class BackPressureError(Exception):
        pass

    class ActorDiedError(Exception):
        pass

    class RayTaskErrorActorDied(ActorDiedError):
        pass

    bp = from_exception(BackPressureError("queue full"))
    assert bp is not None and (bp.status_code, bp.code, bp.retry_after_s) == (503, "overloaded", 1)
    dead = from_exception(RayTaskErrorActorDied("gone"))
    assert dead is not None and (dead.status_code, dead.code) == (503, "replica_lost")
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = ActorDiedError("inner")
    got = from_exception(wrapped)
    assert got is not None and got.code == "replica_lost"


def test_a_wrapped_rejection_is_mapped_with_its_own_message_not_the_remote_traceback() -> None:
    """Ray's RayTaskError dual class passes ``isinstance`` for the cause's class and shows its ``code``,
    but its text is the remote traceback: the client gets the original's message."""
    from llm_service.errors import RequestRejected

    cause = RequestRejected("too_many_blocks", "prompt + max_tokens need 40 KV blocks; the pool has 39")

    class RayTaskErrorRequestRejected(RequestRejected):
        def __init__(self) -> None:
            ValueError.__init__(self, "ray::ServeReplica:... Traceback (most recent call last): ...")
            self.code = cause.code
            self.cause = cause

    api = from_exception(RayTaskErrorRequestRejected())
    assert api is not None and (api.status_code, api.code) == (400, "too_many_blocks")
    assert api.message == "prompt + max_tokens need 40 KV blocks; the pool has 39"
