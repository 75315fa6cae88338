"""``ingress.request_timeout_s``: one deadline per request, end to end (pure asyncio).

The deadline starts when the ingress takes the request. Everything the request awaits runs under it:
reading the body, preparing media (fetch, encode), waiting for the LLM, and every later output of a
streamed answer. Past it, the awaited call is cancelled, which is the same path a client that hangs up
takes: the request's encoder-cache reservations are released and closing the
token stream aborts it on its LLM replica (KV blocks freed). The client gets a 504 ``request_timeout``,
in-band as the last event of a stream that had started.

A stream is checked each time it awaits the next output; time spent handing a chunk to a slow client
counts, and the next wait ends at once when the deadline is past.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

from router.protocol.errors import APIError

T = TypeVar("T")


class Deadline:
    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.at = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s

    def error(self) -> APIError:
        return APIError(
            504,
            f"the request did not finish within {self.timeout_s:g} s (ingress.request_timeout_s)",
            code="request_timeout",
        )

    async def run(self, aw: Awaitable[T]) -> T:
        """``await aw`` under the deadline; past it, ``aw`` is cancelled and a 504 raised."""
        if self.at is None:
            return await aw
        timeout = asyncio.timeout_at(self.at)
        try:
            async with timeout:
                return await aw
        except TimeoutError as e:
            if timeout.expired():
                raise self.error() from e
            raise

    async def stream(self, outputs: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
        """``outputs``' items, each awaited under the deadline; ``outputs`` is closed however it ends."""
        try:
            while True:
                try:
                    item = await self.run(outputs.__anext__())
                except StopAsyncIteration:
                    return
                yield item
        finally:
            await outputs.aclose()
