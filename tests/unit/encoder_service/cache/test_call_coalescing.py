"""CallCoalescer: one call in flight, the calls made meanwhile sent together, each answer to its caller."""

from __future__ import annotations

import asyncio

import pytest

from encoder_service.cache.call_coalescing import CallCoalescer


async def settle() -> None:
    """Let every ready task run (a call's task, then the sender it starts)."""
    for _ in range(5):
        await asyncio.sleep(0)


class Target:
    """Answers ``x -> x * 10`` once released; records every batch it was sent."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = asyncio.Event()
        self.fail_next = False

    async def send(self, args: list[int]) -> list[int]:
        self.batches.append(list(args))
        await self.gate.wait()
        if self.fail_next:
            self.fail_next = False
            raise ValueError("shard says no")
        return [a * 10 for a in args]


def test_a_lone_call_is_sent_at_once_and_calls_made_meanwhile_go_together() -> None:
    async def scenario() -> None:
        target = Target()
        c = CallCoalescer(target.send)
        first = asyncio.ensure_future(c(1))
        await settle()
        assert target.batches == [[1]]  # nothing in flight: sent without waiting for company
        rest = [asyncio.ensure_future(c(i)) for i in (2, 3, 4)]
        await settle()
        assert target.batches == [[1]]  # queued behind the call in flight
        target.gate.set()
        assert await first == 10
        assert await asyncio.gather(*rest) == [20, 30, 40]
        assert target.batches == [[1], [2, 3, 4]]
        assert await c(5) == 50  # idle again: sent at once
        assert target.batches[-1] == [5]

    asyncio.run(scenario())


def test_a_failed_batch_fails_its_own_calls_only() -> None:
    async def scenario() -> None:
        target = Target()
        c = CallCoalescer(target.send)
        target.fail_next = True
        doomed = asyncio.ensure_future(c(1))
        await settle()
        later = asyncio.ensure_future(c(2))
        target.gate.set()
        with pytest.raises(ValueError, match="shard says no"):
            await doomed
        assert await later == 20

    asyncio.run(scenario())


def test_a_cancelled_caller_stops_waiting_but_its_batch_goes_on() -> None:
    async def scenario() -> None:
        target = Target()
        c = CallCoalescer(target.send)
        blocker = asyncio.ensure_future(c(1))
        await settle()
        leaver, stayer = asyncio.ensure_future(c(2)), asyncio.ensure_future(c(3))
        await settle()
        leaver.cancel()
        target.gate.set()
        assert await blocker == 10 and await stayer == 30
        assert leaver.cancelled()
        assert target.batches == [[1], [2, 3]]  # sent all the same: the target may act on it

    asyncio.run(scenario())


def test_an_answer_count_that_does_not_match_is_an_error() -> None:
    async def short(args: list[int]) -> list[int]:
        return args[:-1]

    async def scenario() -> None:
        with pytest.raises(RuntimeError, match="a batch of 1 calls got 0 answers"):
            await CallCoalescer(short)(1)

    asyncio.run(scenario())


def test_a_lone_call_runs_in_its_callers_task_and_the_calls_behind_it_go_next() -> None:
    async def at_once(args: list[int]) -> list[int]:
        return [a * 10 for a in args]

    async def scenario() -> None:
        c = CallCoalescer(at_once)
        coro = c(7)  # nothing in flight and a target that answers at once: no task, no yield
        with pytest.raises(StopIteration) as done:
            coro.send(None)
        assert done.value.value == 70
        target = Target()
        c = CallCoalescer(target.send)
        lone = asyncio.ensure_future(c(1))
        await settle()
        behind = [asyncio.ensure_future(c(i)) for i in (2, 3)]
        await settle()
        lone.cancel()  # the lone caller leaves: the calls queued behind it still go, together
        await settle()
        assert lone.cancelled() and target.batches == [[1], [2, 3]]
        target.gate.set()
        assert await asyncio.gather(*behind) == [20, 30]
        assert await c(4) == 40 and target.batches[-1] == [4]

    asyncio.run(scenario())
