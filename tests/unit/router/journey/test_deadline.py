"""ingress.request_timeout_s: a 504 past the deadline, and what was awaited is cancelled and closed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from router.journey.deadline import Deadline
from router.protocol.errors import APIError


def test_run_cancels_what_it_awaits_and_raises_504() -> None:
    cancelled = []

    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main() -> None:
        with pytest.raises(APIError) as e:
            await Deadline(0.05).run(slow())
        assert e.value.status_code == 504 and e.value.code == "request_timeout"
        assert "request_timeout_s" in e.value.message

    asyncio.run(main())
    assert cancelled == [True]


def test_stream_closes_its_source_past_the_deadline() -> None:
    closed = []

    async def tokens() -> AsyncGenerator[int, None]:
        try:
            for i in range(1000):
                await asyncio.sleep(0.02)
                yield i
        finally:  # where the orchestrator aborts the LLM request and frees its KV blocks
            closed.append(True)

    async def main() -> list[int]:
        got: list[int] = []
        with pytest.raises(APIError) as e:
            async for t in Deadline(0.2).stream(tokens()):
                got.append(t)
        assert e.value.status_code == 504
        return got

    got = asyncio.run(main())
    assert 0 < len(got) < 20 and closed == [True]


def test_no_timeout_and_other_timeouts_pass_through() -> None:
    async def boom() -> None:
        raise TimeoutError("a fetch timed out")  # not the request's deadline: not a 504

    async def main() -> None:
        assert await Deadline(None).run(asyncio.sleep(0, "ok")) == "ok"
        with pytest.raises(TimeoutError):
            await Deadline(10).run(boom())

    asyncio.run(main())
