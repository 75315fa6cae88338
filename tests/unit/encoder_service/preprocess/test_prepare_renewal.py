"""RequestPreparer renews the reservations of a request that prepares slowly, and only of one: a
fast request leaves no task and makes no renewal. A fake cache records the calls; no Ray."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from encoder_service.cache.encoder_cache import COMPUTE
from encoder_service.preprocess.prepare import RequestPreparer


class Cache:
    def __init__(self) -> None:
        self.renewals: list[tuple[str, list[str]]] = []
        self.released: list[str] = []

    async def lookup_or_reserve(self, request_id: str, hashes: list[str]) -> dict[str, Any]:
        return {h: (COMPUTE, None) for h in hashes}

    async def renew(self, request_id: str, hashes: list[str]) -> None:
        self.renewals.append((request_id, list(hashes)))

    async def release(self, request_id: str, hashes: list[str] | None = None) -> None:
        self.released.append(request_id)


class Stop(Exception):
    """Ends the fake preprocessing once it has waited."""


class SlowPreprocess:
    """Looks its one item up (reserving it), then waits ``seconds`` and gives up."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def preprocess(self, messages: Any, lookup: Any, **kwargs: Any) -> Any:
        await lookup(["h1"])
        await asyncio.sleep(self.seconds)
        raise Stop


async def _unused_encode(batch: Any) -> Any:
    raise AssertionError("nothing is encoded here")


def _run(seconds: float) -> tuple[Cache, int, int]:
    """The cache's calls, the renewals made by the time ``prepare`` ended, and the renewal tasks it created."""
    cache = Cache()
    created: list[Any] = []

    def counting_factory(loop: Any, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        created.append(coro)
        return asyncio.Task(coro, loop=loop, **kwargs)

    async def scenario() -> tuple[int, int]:
        asyncio.get_running_loop().set_task_factory(counting_factory)
        preparer = RequestPreparer(SlowPreprocess(seconds), cache, _unused_encode, lease_s=0.3)
        with pytest.raises(Stop):
            await preparer.prepare("r", [])
        # the failure path's shielded release is a task too; count the renewal's own
        at_end, tasks = len(cache.renewals), sum("renew" in c.__qualname__ for c in created)
        await asyncio.sleep(0.25)  # nothing renews once the request is done
        assert len(asyncio.all_tasks()) == 1  # this one
        return at_end, tasks

    at_end, tasks = asyncio.run(scenario())
    assert len(cache.renewals) == at_end
    return cache, at_end, tasks


def test_a_slow_request_renews_its_reservation_every_lease_third() -> None:
    cache, renewals, tasks = _run(0.45)  # renewals at 0.1, 0.2, 0.3, 0.4 s
    assert 3 <= renewals <= 5 and all(r == ("r", ["h1"]) for r in cache.renewals)
    assert tasks == 1 and cache.released == ["r"]  # the renewer, started once the request was slow


def test_a_fast_request_makes_no_renewal_and_leaves_no_task() -> None:
    cache, renewals, tasks = _run(0.0)
    assert renewals == 0 and tasks == 0 and cache.released == ["r"]  # a timer, cancelled
