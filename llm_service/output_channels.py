"""Output channels: one message per engine step per ingress replica, not one per token per request.

An ingress replica submits each request to an LLM replica with a call that answers at once with
the channel to read and then stays open, silent, until the request is done (so Serve's routing and
load counts see the request for its whole life, and cancelling the call aborts it); the outputs flow
back over one long-lived stream per (ingress, LLM replica) pair — the channel. Each engine step
appends its outputs to the channels of their requests, and each channel sends everything it
holds as one ``ChannelBatch`` (vLLM's API server / engine core split does the same with one
socket per front end)::

    ingress A ──submit(r1)──▶ ┐                       ┌─ channel A ──▶ [r1, r3 outputs of step n]
    ingress A ──submit(r3)──▶ ├─ engine step n ──────┤
    ingress B ──submit(r2)──▶ ┘                       └─ channel B ──▶ [r2 outputs of step n]

Lifetime: ``channel_for`` returns the ingress's open channel or opens one; a request registered on
a channel keeps it open. A channel whose requests are all finished and delivered closes after
``linger_s`` without new ones: the check and the close happen with no ``await`` between them, so a
request is never registered on a channel that is closing. The ingress connects to the channel id
that ``submit`` returned; a channel nobody connects to within ``connect_timeout_s`` is dropped and
its requests handed to ``on_orphaned`` (aborted). A connected channel whose stream is cancelled
(the ingress died or hung up) does the same.

Plain asyncio, no Ray: ``LLMServer`` (deployment.py) drives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from llm_service.outputs import RequestOutput


class ChannelGone(RuntimeError):
    """The channel id is unknown here: closed, dropped, or opened on another replica."""


@dataclass
class ChannelBatch:
    """Everything one channel held when it was sent: outputs in step order, and request errors.

    ``replica_id`` is set on the first (empty) batch of a channel, so the ingress knows it is connected
    and where.
    """

    outputs: list[RequestOutput] = field(default_factory=list)
    errors: list[tuple[str, BaseException]] = field(default_factory=list)
    replica_id: str | None = None

    def __bool__(self) -> bool:
        return bool(self.outputs or self.errors)


@dataclass
class _Channel:
    channel_id: str
    ingress_id: str
    created: float
    active: set[str] = field(default_factory=set)
    pending: ChannelBatch = field(default_factory=ChannelBatch)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    connected: bool = False
    closed: bool = False


class OutputChannels:
    """The channels of one LLM replica (all methods run on the replica's event loop)."""

    def __init__(
        self,
        replica_id: str,
        on_orphaned: Callable[[list[str]], None],
        *,
        linger_s: float = 5.0,
        connect_timeout_s: float = 30.0,
    ) -> None:
        self.replica_id = replica_id
        self.linger_s = linger_s
        self.connect_timeout_s = connect_timeout_s
        self._on_orphaned = on_orphaned
        self._ids = itertools.count()
        self._prefix = f"{replica_id}:{os.getpid()}"
        self._channels: dict[str, _Channel] = {}
        self._open: dict[str, str] = {}  # ingress id -> its open channel id
        self._by_request: dict[str, _Channel] = {}
        self._done: dict[str, asyncio.Future[None]] = {}

    def __len__(self) -> int:
        return len(self._channels)

    def register(self, ingress_id: str, request_id: str) -> str:
        """Put ``request_id`` on the ingress's open channel (opening one); returns the channel id."""
        self.drop_unconnected()
        ch = self._channels.get(self._open.get(ingress_id, ""))
        if ch is None or ch.closed:
            ch = _Channel(f"{self._prefix}:{next(self._ids)}", ingress_id, time.monotonic())
            self._channels[ch.channel_id] = ch
            self._open[ingress_id] = ch.channel_id
        ch.active.add(request_id)
        self._by_request[request_id] = ch
        self._done[request_id] = asyncio.get_running_loop().create_future()
        return ch.channel_id

    def done(self, request_id: str) -> asyncio.Future[None]:
        """Resolves when the request's last output or error is queued on its channel (or it is dropped)."""
        fut = self._done.get(request_id)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(None)
        return fut

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """One engine step's outputs, each to its request's channel."""
        touched: dict[str, _Channel] = {}
        for out in outputs:
            ch = self._by_request.get(out.request_id)
            if ch is None:
                continue
            ch.pending.outputs.append(out)
            if out.finished:
                self._finish(ch, out.request_id)
            touched[ch.channel_id] = ch
        for ch in touched.values():
            ch.wakeup.set()

    def fail(self, request_id: str, error: BaseException) -> None:
        ch = self._by_request.get(request_id)
        if ch is None:
            return
        ch.pending.errors.append((request_id, error))
        self._finish(ch, request_id)
        ch.wakeup.set()

    def holds(self, request_id: str) -> bool:
        """``request_id`` is still on an open channel (not finished, forgotten or orphaned)."""
        return request_id in self._by_request

    def forget(self, request_id: str) -> None:
        """The request was aborted by its ingress: nothing more is sent for it."""
        ch = self._by_request.get(request_id)
        if ch is not None:
            self._finish(ch, request_id)
            ch.wakeup.set()

    def _finish(self, ch: _Channel, request_id: str) -> None:
        ch.active.discard(request_id)
        self._by_request.pop(request_id, None)
        fut = self._done.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def stream(self, channel_id: str) -> AsyncIterator[ChannelBatch]:
        """The channel's batches until it closes; orphans its requests if the reader goes away."""
        ch = self._channels.get(channel_id)
        if ch is None or ch.connected or ch.closed:
            raise ChannelGone(f"output channel {channel_id} is not open on replica {self.replica_id}")
        ch.connected = True
        try:
            yield ChannelBatch(replica_id=self.replica_id)  # hello: the ingress knows where it landed
            while True:
                if ch.pending:
                    ch.wakeup.clear()  # what woke us is in this batch
                    batch, ch.pending = ch.pending, ChannelBatch()
                    yield batch
                    continue
                if not ch.active:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(ch.wakeup.wait(), self.linger_s)
                    if not ch.active and not ch.pending:  # no await since the check: atomic
                        self._close(ch)
                        return
                else:
                    await ch.wakeup.wait()
                ch.wakeup.clear()
        finally:
            if not ch.closed:
                self._close(ch)

    def _close(self, ch: _Channel) -> None:
        ch.closed = True
        self._channels.pop(ch.channel_id, None)
        if self._open.get(ch.ingress_id) == ch.channel_id:
            del self._open[ch.ingress_id]
        orphans = sorted(ch.active)
        for rid in orphans:
            self._finish(ch, rid)
        if orphans:
            self._on_orphaned(orphans)

    def drop_unconnected(self, now: float | None = None) -> None:
        """Channels nobody connected to in time (their ingress died between submit and connect)."""
        now = time.monotonic() if now is None else now
        for ch in list(self._channels.values()):
            if not ch.connected and now - ch.created > self.connect_timeout_s:
                self._close(ch)
