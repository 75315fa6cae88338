"""Coalesced calls: at most one call in flight to a target, the calls made meanwhile sent together next.

    caller a ──▶ ┐                      ┌──▶ send([a])        (nothing in flight: sent at once)
    caller b ──▶ ├─ CallCoalescer ──────┤
    caller c ──▶ ┘                      └──▶ send([b, c])     (queued while [a] was in flight)

No call waits for company: an idle target gets each call at once, sent from the caller's own task,
so a lone request pays nothing, and under load a target that answers in ``t`` gets one call per
``t`` however many callers there are.
This is Nagle's algorithm without its timer, applied to the encoder-cache shards, whose per-call cost
(an actor call, ~1.4 CPU-ms here) dominated what they do per item. Pure asyncio: no Ray import.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

A = TypeVar("A")
R = TypeVar("R")


class CallCoalescer(Generic[A, R]):
    """``await coalescer(arg)`` is ``send([..., arg, ...])``'s answer for ``arg``.

    ``send`` takes the arguments of every call queued since the last batch, in call order, and
    returns one answer per argument, in the same order. If it raises, every call of that batch raises
    the same exception. A caller cancelled while its batch is in flight only stops waiting: the batch
    is not cancelled (the target may already have acted on it; the caller's cleanup is its own).
    """

    def __init__(self, send: Callable[[list[A]], Awaitable[list[R]]]) -> None:
        self._send = send
        self._queued: list[tuple[A, asyncio.Future[R]]] = []
        self._sender: asyncio.Task[None] | None = None
        self._lone = False  # a lone call is in flight, sent from its caller's own task

    async def __call__(self, arg: A) -> R:
        if self._sender is None and not self._lone:
            return await self._send_lone(arg)
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queued.append((arg, future))
        return await future

    async def _send_lone(self, arg: A) -> R:
        """Nothing in flight: the caller sends its own batch of one and awaits it in its own task
        (a sender task would cost it two turns of a busy loop). A caller cancelled meanwhile cancels
        its own await of ``send`` (an actor call already made still runs on the target). Whatever
        was queued behind it goes next, in a sender task."""
        self._lone = True
        try:
            answers = await self._send([arg])
        finally:
            self._lone = False
            if self._queued and self._sender is None:
                self._sender = asyncio.get_running_loop().create_task(self._send_queued())
        if len(answers) != 1:
            raise RuntimeError(f"a batch of 1 calls got {len(answers)} answers")
        return answers[0]

    async def _send_queued(self) -> None:
        try:
            while self._queued:
                batch, self._queued = self._queued, []
                try:
                    answers = await self._send([arg for arg, _ in batch])
                    if len(answers) != len(batch):
                        raise RuntimeError(f"a batch of {len(batch)} calls got {len(answers)} answers")
                except asyncio.CancelledError:  # this task is cancelled: so are its callers
                    for _, future in batch:
                        future.cancel()
                    raise
                except Exception as e:  # every caller of the batch learns why, then it goes on
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(e)
                    continue
                for (_, future), answer in zip(batch, answers, strict=True):
                    if not future.done():  # a cancelled caller: nobody waits for its answer
                        future.set_result(answer)
        finally:
            self._sender = None
            for _, future in self._queued:  # only if this task itself was cancelled
                if not future.done():
                    future.cancel()
            self._queued = []
