"""A plain long-lived socket between an ingress replica and the one replica of a pool (``transport``).

A Serve handle call costs ~1.2–1.5 CPU-ms over all processes and ~0.6–1.4 ms of wall time here; a
request and its reply as frames on an open loopback TCP connection cost ~0.02–0.1 CPU-ms and 0.1 ms
(``python -m cluster.bench_transport``). So where a pool runs exactly one replica, and there is no
routing to do and no autoscaling to feed, the ingress sends ``prepare`` and ``submit`` as frames:

    client ──len, token (raw bytes)──▶ server    once per connection; a wrong token is hung up on
                                                 (nothing is unpickled before the token matched)
    client ──(seq, method, args)──▶ server       a call: the server runs ``handlers[method](*args)``
    client ──(seq, None, None)──▶ server         the caller left: the server cancels that call
    client ◀──(seq, ok, value or exception)──    the answer

A frame is a 4-byte big-endian length and a pickle, made by the ``dumps`` the wiring gives
(cluster/direct_served.py: ``frame_dumps``, Ray's pickler "in band": each ObjectRef written with its
owner's address and not pinned). The owner keeps the object alive, as in Serve's gRPC transport
(README, "No pins"); the 500-request leak test runs on this transport. A connection that breaks
fails every call still waiting on it with ``LinkLost``, which the callers treat as their replica
gone (``router.errors.replica_gone``): they retry through Serve, and the link rests
``LOST_BACKOFF_S`` before it asks Serve where the replica (or its successor) listens again.

No Ray here: the replica's wiring (cluster/app.py) gives the server its host and the handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import pickle
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger("mmserve.router")

MAX_FRAME_BYTES = 1 << 30  # a guard against a garbled stream, far above any request's bound
_HEADER = struct.Struct("!I")
_HELLO = struct.Struct("!H")  # the token's length; the token follows, raw
MAX_TOKEN_BYTES = 1024
LOST_BACKOFF_S = 5.0  # after a lost link, calls go through Serve this long

Handler = Callable[..., Awaitable[Any]]


class LinkLost(ConnectionError):
    """The connection to the pool's replica broke (or never opened) with the call unanswered."""

    status_code = 503
    code = "replica_link_lost"


Dumps = Callable[[Any], bytes]


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=5)


def _frame(obj: Any, dumps: Dumps = _pickle) -> bytes:
    body = dumps(obj)
    return _HEADER.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise ConnectionError(f"frame of {size} bytes is past the {MAX_FRAME_BYTES} bound")
    return pickle.loads(await reader.readexactly(size))


def _answer(seq: int, ok: bool, value: Any, dumps: Dumps) -> bytes:
    """The reply frame; one that does not pickle still answers, with what went wrong."""
    try:
        return _frame((seq, ok, value), dumps)
    except Exception as e:
        what = "result" if ok else "error"
        return _frame((seq, False, RuntimeError(f"direct link: unpicklable {what} {value!r}: {e!r}")))


def _forget(running: dict[int, asyncio.Task[None]], seq: int, _: asyncio.Task[None]) -> None:
    running.pop(seq, None)


class LinkServer:
    """The replica's end: one asyncio server, any number of client connections."""

    def __init__(self, handlers: dict[str, Handler], token: str, dumps: Dumps = _pickle) -> None:
        self.handlers = handlers
        self.token = token
        self.dumps = dumps
        self._server: asyncio.Server | None = None
        self._address: tuple[str, int] | None = None
        self._lock = asyncio.Lock()
        self.calls = 0
        self.draining = False

    async def address(self, host: str) -> tuple[str, int]:
        """Listen on ``host`` (an ephemeral port) the first time; where clients connect."""
        async with self._lock:
            if self._address is None:
                self._server = await asyncio.start_server(self._serve, host, 0)
                self._address = (host, int(self._server.sockets[0].getsockname()[1]))
        return self._address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    def drain(self) -> None:
        """The replica is shutting down: calls already running finish; every later call is answered
        ``LinkLost`` without running, so its caller sends it through Serve, to the replica's successor."""
        self.draining = True
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        running: dict[int, asyncio.Task[None]] = {}
        try:
            # The token comes as raw bytes, never a pickle: nothing from an unproven peer is unpickled.
            hello = await asyncio.wait_for(reader.readexactly(_HELLO.size), 10.0)
            (size,) = _HELLO.unpack(hello)
            token = await asyncio.wait_for(reader.readexactly(size), 10.0) if size <= MAX_TOKEN_BYTES else b""
            if not hmac.compare_digest(token, self.token.encode()):
                logger.warning("direct link: a connection without the cluster's token was refused")
                return
            while True:
                seq, method, args = await _read_frame(reader)
                if method is None:  # its caller left
                    if (task := running.get(seq)) is not None:
                        task.cancel()
                    continue
                self.calls += 1
                task = asyncio.get_running_loop().create_task(self._run(writer, seq, method, args))
                running[seq] = task
                task.add_done_callback(functools.partial(_forget, running, seq))
        except (
            asyncio.IncompleteReadError,
            ConnectionError,
            TimeoutError,
            pickle.UnpicklingError,
            ValueError,
        ):
            pass  # the client went away (or spoke garbage): its calls end with it
        finally:
            for task in list(running.values()):
                task.cancel()
            writer.close()

    async def _run(self, writer: asyncio.StreamWriter, seq: int, method: str, args: tuple[Any, ...]) -> None:
        handler = self.handlers.get(method)
        try:
            if self.draining:
                raise LinkLost("the replica is shutting down; not run")
            if handler is None:
                raise LookupError(f"direct link: no method {method!r}")
            reply = _answer(seq, True, await handler(*args), self.dumps)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the caller gets the error as Serve would give it
            reply = _answer(seq, False, e, self.dumps)
        if not writer.is_closing():
            writer.write(reply)


class LinkClient:
    """One connection to a replica's ``LinkServer``; calls are multiplexed on it by sequence number."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, where: str, dumps: Dumps = _pickle
    ) -> None:
        self._writer = writer
        self._dumps = dumps
        self._where = where
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._seq = 0
        self.lost: BaseException | None = None
        self._pump = asyncio.get_running_loop().create_task(self._read(reader))

    @classmethod
    async def connect(
        cls, host: str, port: int, token: str, timeout_s: float = 10.0, dumps: Dumps = _pickle
    ) -> LinkClient:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
        except (OSError, TimeoutError) as e:
            raise LinkLost(f"could not connect to {host}:{port}: {e!r}") from e
        raw = token.encode()
        writer.write(_HELLO.pack(len(raw)) + raw)
        return cls(reader, writer, f"{host}:{port}", dumps)

    async def call(self, method: str, *args: Any) -> Any:
        if self.lost is not None:
            raise LinkLost(f"link to {self._where} lost: {self.lost!r}")
        self._seq += 1
        seq = self._seq
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[seq] = fut
        self._writer.write(_frame((seq, method, args), self._dumps))
        try:
            return await fut
        except asyncio.CancelledError:
            if self._waiting.pop(seq, None) is not None and not self._writer.is_closing():
                self._writer.write(_frame((seq, None, None)))  # stop it on the replica
            raise

    def close(self) -> None:
        self._pump.cancel()
        self._writer.close()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                seq, ok, value = await _read_frame(reader)
                fut = self._waiting.pop(seq, None)
                if fut is None or fut.done():
                    continue
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)
        except BaseException as e:
            self.lost = e
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_exception(LinkLost(f"link to {self._where} broke: {e!r}"))
            self._waiting.clear()
            self._writer.close()
            if isinstance(e, asyncio.CancelledError):
                raise


class DirectLink:
    """Calls to a pool's one replica, reconnecting after a loss. ``locate()`` answers where that
    replica listens (the ingress asks it through Serve: ``handle.direct_address.remote()``)."""

    def __init__(
        self, locate: Callable[[], Awaitable[tuple[str, int]]], token: str, dumps: Dumps = _pickle
    ) -> None:
        self._locate = locate
        self._token = token
        self._dumps = dumps
        self._client: LinkClient | None = None
        self._lock: asyncio.Lock | None = None
        self.connects = 0
        self.losses = 0
        self._down_until = 0.0

    def usable(self) -> bool:
        """False for ``LOST_BACKOFF_S`` after a loss: meanwhile callers go through Serve, which knows
        when the replica's successor is up (asking it for an address might reach the dying one)."""
        return time.monotonic() >= self._down_until

    async def call(self, method: str, *args: Any) -> Any:
        client = self._client
        if client is None or client.lost is not None:
            client = await self._connect()
        try:
            return await client.call(method, *args)
        except LinkLost:
            if self._client is client:
                self._client = None
            self.losses += 1
            self._down_until = time.monotonic() + LOST_BACKOFF_S
            raise

    async def _connect(self) -> LinkClient:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._client is not None and self._client.lost is None:
                return self._client
            try:
                host, port = await self._locate()
                self._client = await LinkClient.connect(host, port, self._token, dumps=self._dumps)
            except Exception:  # (a caller that left while connecting costs the link nothing)
                self._down_until = time.monotonic() + LOST_BACKOFF_S
                raise
            self.connects += 1
            return self._client

    def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None
