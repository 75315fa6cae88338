"""``gather``: ``asyncio.gather`` that awaits a lone awaitable in the caller's own task.

``asyncio.gather`` wraps every coroutine in a task: one turn of the event loop before it starts,
and one more after it ends before the caller resumes. On a busy ingress loop at image c=32 here a
turn is ~5 ms, and one cache shard (what one machine runs) makes every per-shard fan-out a gather of
one. Pure asyncio.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def gather(*aws: Awaitable[T]) -> list[T]:
    """The results of ``aws`` in order; the first exception propagates (``asyncio.gather``'s
    default), and none at all is an empty list."""
    if not aws:
        return []
    if len(aws) == 1:
        return [await aws[0]]
    return list(await asyncio.gather(*aws))
