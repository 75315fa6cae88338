"""ZeroMQ sockets between a caller (an ingress replica, a cache client) and the replicas of a pool.

A Serve handle call costs ~1.2–1.5 CPU-ms over all processes; a request and its reply on an open
ZeroMQ connection ~0.1–0.2 (``python -m cluster.bench.transport``). So the ingress sends ``prepare``
and ``submit`` (and a cache client its shards' hot methods) on a ZeroMQ DEALER socket to the chosen
replica's ROUTER, as vLLM and SGLang connect their API server and engine: one ``DirectLink`` per
(caller process, replica), however many replicas the pool runs and however it autoscales
(``PoolLinks`` in pool_links.py picks the replica as the pool's Serve router would). Each message is
multipart: a small msgpack header and a body::

    client ──[seq, method, timeout_ms] + dumps(args)──▶ server   a call: ``handlers[method](*args)``
    client ──[seq, None, None]──▶ server                         the caller left: cancel that call
    client ◀──[seq, OK] + dumps(value)──                         the answer
    client ◀──[seq, RAISED] + dumps(exception)──                 the handler raised
    client ◀──[seq, FAILED, code, message]──                     not run, or not answerable (below)
    client ◀──[seq, MORE] + dumps(item)── … ──[seq, OK]──           a stream: an async generator handler's
                                                                   items in order, then its end

**Who may talk.** Every connection is authenticated during ZeroMQ's handshake, before any message
is delivered, by a ZAP authenticator in the server's own context (``zmq.auth.asyncio``). With
``LinkKeys.encrypt`` (the default) the mechanism is CURVE: the server holds the cluster's server key
pair and accepts only the cluster's client public key; every message is encrypted and authenticated
with the session's keys, so nothing can be read or injected on the wire. Without it the mechanism
is PLAIN: the client presents a password (the cluster's secret) that the server checks in constant
time, and the messages travel in clear, for one machine where the wire is loopback (CURVE cost no
measurable CPU there either; see the README's transport table). A server refuses to listen, and a client
to connect, with PLAIN anywhere but loopback (``PlainOffLoopback``; a replica at its start). A peer with no key or a wrong key fails the
handshake; no frame of it reaches ``loads`` or a handler.

**Why unpickling is safe here.** The bodies are made by the ``dumps`` the wiring gives: Ray's
cloudpickle "in band" (mmcore/link/on_ray.py ``frame_dumps``), because ObjectRefs ride in the
records and Ray's deserialiser turns them back into counted borrows of their owner's objects. A
pickle can run code; so ``loads`` runs only on messages of a connection whose peer proved it holds
the cluster's keys. Those live in Ray's internal KV (the GCS), which only a process that can already
submit tasks, i.e. run any code on the cluster, can read: such a peer gains nothing by sending a
malicious pickle. Undecodable bytes from it fail the one call they belong to (FAILED
``bad_frame``), or are dropped when even the header does not decode; the connection goes on.

**Bounds.** A body travels in parts of at most ``PART_BYTES`` (1 MiB), one ZeroMQ frame each, of one
multipart message (so a large one keeps the heartbeat going: Liveness, below). A body past
``max_frame_bytes`` is refused at its sender (``FrameTooLarge``, the call fails, the connection goes
on); a peer that sends a frame past a part anyway is cut off by ZeroMQ before the frame is read
(``ZMQ_MAXMSGSIZE``), and a message of more parts than the bound fails its call (``bad_frame``). Each
socket queues at most ``hwm`` messages each way (SNDHWM/RCVHWM). A client whose queue to the server is
full gets ``LinkBusy`` (a 503) at once; a server running ``max_in_flight`` calls, or calls whose
arguments hold ``max_in_flight_bytes`` (1 GiB; a larger call alone is let in), answers later ones
``LinkBusy`` unrun; a reply to a client that does not read waits (holding its call's slot) at most
``REPLY_PATIENCE_S`` and is then dropped. So memory stays within ~(2·hwm + max_in_flight) frames per
connection, the running calls' arguments within ``max_in_flight_bytes``, and an overload is a fast 503.

**Liveness.** ZeroMQ heartbeats (``HEARTBEAT_S``): a peer that answers no PING for
``3 * HEARTBEAT_S`` is disconnected (libzmq counts any whole frame received as an answer, and restarts
its timer only then: a body in one 256 MiB frame that took over 3 s to arrive, a video's embeddings on
a busy link, used to drop the connection with every call on it; in 1 MiB parts it takes a link slower
than ~350 kB/s), and the client's socket monitor then fails every call waiting
on that connection with ``LinkLost`` — which the callers treat as their replica gone
(``router.protocol.errors.replica_gone``): they retry through Serve, and the link rests ``LOST_BACKOFF_S``
before it asks Serve where the replica (or its successor) listens again. ZeroMQ's I/O thread answers
the PINGs, so a replica whose event loop is stuck still looks alive: for that, each call has a deadline
(``timeout_s``, or the link's default): past it the call fails with ``LinkTimeout`` and is cancelled
on the server (a cancel frame; the header's ``timeout_ms`` makes the server cancel it too, should the
cancel frame be lost). A handler that is cancelled by its own doing (an inner task cancelled under
it, not a cancel frame or its deadline) is answered at once, FAILED ``cancelled`` (``CallCancelled``,
a 503): its caller does not wait out the deadline for a reply that would never come. A client that
vanishes leaves its running calls to finish or reach their deadline (ZeroMQ's ROUTER reports no per-peer disconnect without its draft API).

No Ray here but in on_ray.py (the keys, the in-band pickle), which the wiring (cluster/replica_links.py)
gives each end with its handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from mmcore.link.client import LinkClient
from mmcore.link.frames import (
    DEFAULT_TIMEOUT_S,
    HWM,
    LOST_BACKOFF_S,
    MAX_FRAME_BYTES,
    BadFrame,
    CallCancelled,
    Dumps,
    FrameTooLarge,
    LinkBusy,
    LinkKeys,
    LinkLost,
    LinkTimeout,
    Loads,
    PlainOffLoopback,
    check_mechanism,
    pickle_dumps,
)
from mmcore.link.server import LinkServer

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "LOST_BACKOFF_S",
    "BadFrame",
    "CallCancelled",
    "DirectLink",
    "FrameTooLarge",
    "LinkBusy",
    "LinkClient",
    "LinkKeys",
    "LinkLost",
    "LinkServer",
    "LinkTimeout",
    "PlainOffLoopback",
    "check_mechanism",
]


@dataclass(frozen=True)
class _ClientOptions:
    """What ``DirectLink`` opens each ``LinkClient`` with."""

    dumps: Dumps
    loads: Loads
    timeout_s: float | None
    max_frame_bytes: int
    hwm: int


class DirectLink:
    """Calls to one replica of a pool, reconnecting after a loss. ``locate()`` answers where that
    replica listens (its routing stats, or ``handle.direct_address.remote()`` through Serve). Callers
    that find no connection share one attempt to open it (bounded by ``CONNECT_TIMEOUT_S`` once
    located), so a lost replica costs them one wait together, not one each in turn."""

    def __init__(
        self,
        locate: Callable[[], Awaitable[tuple[str, int]]],
        keys: LinkKeys,
        dumps: Dumps = pickle_dumps,
        loads: Loads = pickle.loads,
        *,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        hwm: int = HWM,
    ) -> None:
        self._locate = locate
        self._keys = keys
        self._options = _ClientOptions(dumps, loads, timeout_s, max_frame_bytes, hwm)
        self._client: LinkClient | None = None
        self._connecting: asyncio.Task[LinkClient] | None = None
        self.connects = 0
        self.losses = 0
        self._down_until = 0.0

    def usable(self) -> bool:
        """False for ``LOST_BACKOFF_S`` after a loss: meanwhile callers go through Serve, which knows
        when the replica's successor is up (asking it for an address might reach the dying one)."""
        return time.monotonic() >= self._down_until

    async def call(
        self, method: str, *args: object, timeout_s: float | None = None
    ) -> Any:  # Any: what the replica's method returns; its caller names the type
        """``method(*args)`` on the replica; ``timeout_s`` (else the link's) is the call's deadline."""
        client = self._client
        if client is None or client.lost is not None or client.retiring:
            client = await self._connect()
        try:
            return await client.call(method, *args, timeout_s=timeout_s)
        except LinkLost:
            self._lost(client)
            raise

    async def stream(
        self, method: str, *args: object, timeout_s: float | None = None
    ) -> AsyncGenerator[Any, None]:  # Any: what the replica's method yields; its caller names the type
        """The items ``method(*args)`` yields on the replica (``LinkClient.stream``); no deadline
        unless ``timeout_s``. A lost connection raises ``LinkLost`` here, at any point."""
        client = self._client
        if client is None or client.lost is not None or client.retiring:
            client = await self._connect()
        try:
            async with contextlib.aclosing(client.stream(method, *args, timeout_s=timeout_s)) as items:
                async for item in items:
                    yield item
        except LinkLost:
            self._lost(client)
            raise

    def _lost(self, client: LinkClient) -> None:
        if self._client is client:
            self._client = None
        client.retire()  # (a draining replica still answers the calls it runs)
        self.losses += 1
        self._down_until = time.monotonic() + LOST_BACKOFF_S

    async def _connect(self) -> LinkClient:
        if self._connecting is None:
            self._connecting = asyncio.get_running_loop().create_task(self._open())
            self._connecting.add_done_callback(_retrieve)
        return await asyncio.shield(self._connecting)  # a caller that leaves leaves the others' attempt

    async def _open(self) -> LinkClient:
        try:
            host, port = await self._locate()
            o = self._options
            client = await LinkClient.connect(
                host,
                port,
                self._keys,
                dumps=o.dumps,
                loads=o.loads,
                timeout_s=o.timeout_s,
                max_frame_bytes=o.max_frame_bytes,
                hwm=o.hwm,
            )
        except Exception:
            self._down_until = time.monotonic() + LOST_BACKOFF_S
            raise
        finally:
            self._connecting = None
        self._client = client
        self.connects += 1
        return client

    def retire(self) -> None:
        """No new calls; the connection closes once what runs on it (calls, streams) has ended."""
        self._down_until = float("inf")
        if self._client is not None:
            self._client.retire()
            self._client = None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _retrieve(task: asyncio.Task[LinkClient]) -> None:
    if not task.cancelled():
        task.exception()  # read by its waiters, if any are left; never "never retrieved"
