"""ZeroMQ sockets between an ingress replica and the one replica of a pool (``transport``).

A Serve handle call costs ~1.2–1.5 CPU-ms over all processes; a request and its reply on an open
ZeroMQ connection ~0.1–0.2 (``python -m cluster.bench_transport``). So where a pool runs exactly one
replica, and there is no routing to do and no autoscaling to feed, the ingress sends ``prepare`` and
``submit`` on a ZeroMQ DEALER socket to the replica's ROUTER, as vLLM and SGLang connect their API
server and engine. Each message is multipart: a small msgpack header and a body::

    client ──[seq, method, timeout_ms] + dumps(args)──▶ server   a call: ``handlers[method](*args)``
    client ──[seq, None, None]──▶ server                         the caller left: cancel that call
    client ◀──[seq, OK] + dumps(value)──                         the answer
    client ◀──[seq, RAISED] + dumps(exception)──                 the handler raised
    client ◀──[seq, FAILED, code, message]──                     not run, or not answerable (below)

**Who may talk.** Every connection is authenticated during ZeroMQ's handshake, before any message
is delivered, by a ZAP authenticator in the server's own context (``zmq.auth.asyncio``). With
``LinkKeys.encrypt`` (the default) the mechanism is CURVE: the server holds the cluster's server key
pair and accepts only the cluster's client public key; every message is encrypted and authenticated
with the session's keys, so nothing can be read or injected on the wire. Without it the mechanism
is PLAIN: the client presents a password (the cluster's secret) that the server checks, and the
messages travel in clear, for one machine where the wire is loopback (CURVE cost no measurable CPU
there either; see the README's transport table). A peer with no key or a wrong key fails the
handshake; no frame of it reaches ``loads`` or a handler.

**Why unpickling is safe here.** The bodies are made by the ``dumps`` the wiring gives: Ray's
cloudpickle "in band" (cluster/direct_served.py ``frame_dumps``), because ObjectRefs ride in the
records and Ray's deserialiser turns them back into counted borrows of their owner's objects. A
pickle can run code; so ``loads`` runs only on messages of a connection whose peer proved it holds
the cluster's keys. Those live in Ray's internal KV (the GCS), which only a process that can already
submit tasks, i.e. run any code on the cluster, can read: such a peer gains nothing by sending a
malicious pickle. Undecodable bytes from it fail the one call they belong to (FAILED
``bad_frame``), or are dropped when even the header does not decode; the connection goes on.

**Bounds.** A body past ``max_frame_bytes`` is refused at its sender (``FrameTooLarge``, the call
fails, the connection goes on); a peer that sends one anyway is cut off by ZeroMQ before the frame
is read (``ZMQ_MAXMSGSIZE``). Each socket queues at most ``hwm`` messages each way (SNDHWM/RCVHWM).
A client whose queue to the server is full gets ``LinkBusy`` (a 503) at once; a server running
``max_in_flight`` calls answers later ones ``LinkBusy`` unrun; a reply to a client that does not
read waits (holding its call's slot) at most ``REPLY_PATIENCE_S`` and is then dropped. So memory
stays within ~(2·hwm + max_in_flight) frames per connection, and an overload is a fast 503.

**Liveness.** ZeroMQ heartbeats (``HEARTBEAT_S``): a peer that answers no PING for
``3 * HEARTBEAT_S`` is disconnected, and the client's socket monitor then fails every call waiting
on that connection with ``LinkLost`` — which the callers treat as their replica gone
(``router.errors.replica_gone``): they retry through Serve, and the link rests ``LOST_BACKOFF_S``
before it asks Serve where the replica (or its successor) listens again. ZeroMQ's I/O thread answers
the PINGs, so a replica whose event loop is stuck still looks alive: for that, each call has a deadline
(``timeout_s``, or the link's default): past it the call fails with ``LinkTimeout`` and is cancelled
on the server (a cancel frame; the header's ``timeout_ms`` makes the server cancel it too, should the
cancel frame be lost). A client that vanishes leaves its running calls to finish or reach their
deadline (ZeroMQ's ROUTER reports no per-peer disconnect without its draft API).

No Ray here: the replica's wiring (cluster/direct_served.py) gives the keys, codec and handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import pickle
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import msgpack
import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

logger = logging.getLogger("mmserve.router")

MAX_FRAME_BYTES = 256 << 20  # a body's bound (the ingress's requests are bounded at 64 MiB by default)
HWM = 1024  # messages each socket queues each way
MAX_IN_FLIGHT = 1024  # calls a server runs at once; past it LinkBusy
HEARTBEAT_S = 1.0  # PING every second; no answer for 3 s: the peer is gone
CONNECT_TIMEOUT_S = 5.0  # TCP + handshake + authentication
DEFAULT_TIMEOUT_S = 300.0  # a call's deadline unless its caller gives one (the ingress's request timeout)
REPLY_PATIENCE_S = 10.0  # how long a reply waits for a client that does not read
LOST_BACKOFF_S = 5.0  # after a lost link, calls go through Serve this long
_USER = b"mmserve"  # PLAIN's user name (the password is the secret)

OK, RAISED, FAILED = 0, 1, 2  # a reply's status

Handler = Callable[..., Awaitable[Any]]
Dumps = Callable[[Any], bytes]
Loads = Callable[[bytes], Any]


class LinkLost(ConnectionError):
    """The connection to the pool's replica broke (or never opened), or the replica is shutting down,
    with the call unanswered: its callers send it through Serve."""

    status_code = 503
    code = "replica_link_lost"


class LinkBusy(RuntimeError):
    """Too many calls queued or running on the link: refused at once, not run."""

    status_code = 503
    code = "overloaded"
    retry_after_s = 1


class LinkTimeout(TimeoutError):
    """The call's deadline passed; it was cancelled on the replica."""

    status_code = 504
    code = "replica_link_timeout"


class FrameTooLarge(ValueError):
    """A body past the link's frame bound: refused by its sender, the connection goes on."""

    status_code = 413
    code = "frame_too_large"


class BadFrame(RuntimeError):
    """A frame that did not decode: that one call fails, the connection goes on."""

    status_code = 500
    code = "bad_frame"


_FAILURES: dict[str, type[Exception]] = {
    "lost": LinkLost,
    "busy": LinkBusy,
    "too_large": FrameTooLarge,
    "bad_frame": BadFrame,
}


@dataclass(frozen=True)
class LinkKeys:
    """A cluster's link credentials: one CURVE key pair for every server, one for every client (z85).
    ``encrypt=False``: PLAIN, the client secret as password, messages in clear (one machine)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    encrypt: bool = True

    @classmethod
    def generate(cls, encrypt: bool = True) -> LinkKeys:
        if encrypt and not zmq.has("curve"):
            raise RuntimeError(
                "this libzmq has no CURVE; install a pyzmq wheel (it bundles one) or encrypt=False"
            )
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret, encrypt)

    def to_bytes(self) -> bytes:
        return bytes(msgpack.packb(list(vars(self).values())))

    @classmethod
    def from_bytes(cls, raw: bytes) -> LinkKeys:
        return cls(*msgpack.unpackb(raw))


class _ClientKey:
    """The ZAP check: CURVE's client key must be the cluster's."""

    def __init__(self, z85_key: bytes) -> None:
        self.key = z85_key

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.key)


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=5)


def _endpoint(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _tune(sock: zmq.asyncio.Socket, hwm: int, max_frame_bytes: int, ipv6: bool) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + 4096)  # a body plus a header, per frame
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(3 * HEARTBEAT_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(3 * HEARTBEAT_S * 1000))
    sock.setsockopt(zmq.IPV6, int(ipv6))


def _failed(seq: int, code: str, message: str) -> list[bytes]:
    return [msgpack.packb([seq, FAILED, code, message]), b""]


def _send_nowait(sock: zmq.asyncio.Socket, frames: list[bytes]) -> BaseException | None:
    """Send without waiting; what went wrong (``zmq.Again``: the queue is full), or None. With
    ``DONTWAIT`` pyzmq's future is done on return (no send here ever waits in its queue)."""
    sent = cast("asyncio.Future[Any]", sock.send_multipart(frames, flags=zmq.DONTWAIT))
    return sent.exception() if sent.done() else None


async def _recv_batch(sock: zmq.asyncio.Socket, most: int = 256) -> list[list[bytes]] | None:
    """One message awaited, then those already queued behind it (up to ``most``); None: closed."""
    try:
        batch = [await sock.recv_multipart()]
        while len(batch) < most:
            batch.append(
                cast("asyncio.Future[list[bytes]]", sock.recv_multipart(flags=zmq.DONTWAIT)).result()
            )
    except zmq.Again:
        pass
    except zmq.ZMQError:
        return None
    return batch


def _decode_header(raw: bytes) -> list[Any] | None:
    try:
        header = msgpack.unpackb(raw)
    except Exception:
        return None
    if not isinstance(header, list) or len(header) < 2 or not isinstance(header[0], int):
        return None
    return header


class LinkServer:
    """The replica's end: one ROUTER socket, any number of authenticated client connections."""

    def __init__(
        self,
        handlers: dict[str, Handler],
        keys: LinkKeys,
        dumps: Dumps = _pickle,
        loads: Loads = pickle.loads,
        *,
        max_in_flight: int = MAX_IN_FLIGHT,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        hwm: int = HWM,
        reply_patience_s: float = REPLY_PATIENCE_S,
    ) -> None:
        self.handlers = handlers
        self.keys = keys
        self.dumps = dumps
        self.loads = loads
        self.max_in_flight = max_in_flight
        self.max_frame_bytes = max_frame_bytes
        self.hwm = hwm
        self.reply_patience_s = reply_patience_s
        self._ctx: zmq.asyncio.Context | None = None
        self._auth: AsyncioAuthenticator | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._pump: asyncio.Task[None] | None = None
        self._running: dict[tuple[bytes, int], asyncio.Task[None]] = {}  # (client, seq) -> its call
        self._address: tuple[str, int] | None = None
        self._lock = asyncio.Lock()
        self.calls = 0  # calls run
        self.refused = 0  # answered LinkBusy
        self.garbled = 0  # frames that did not decode
        self.dropped = 0  # replies given up on (their client did not read)
        self.draining = False

    async def address(self, host: str) -> tuple[str, int]:
        """Listen on ``host`` (an ephemeral port) the first time; where clients connect."""
        async with self._lock:
            if self._address is None:
                self._address = self._listen(host)
        return self._address

    def _listen(self, host: str) -> tuple[str, int]:
        self._ctx = zmq.asyncio.Context()
        self._auth = AsyncioAuthenticator(self._ctx)  # before the bind: no handshake goes unchecked
        self._auth.start()
        sock = self._sock = self._ctx.socket(zmq.ROUTER)
        _tune(sock, self.hwm, self.max_frame_bytes, ":" in host)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue to a client is EAGAIN, not a silent drop
        if self.keys.encrypt:
            self._auth.configure_curve_callback("*", _ClientKey(self.keys.client_public))
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.server_secret)
        else:
            self._auth.configure_plain("*", {_USER.decode(): self.keys.client_secret.decode()})
            sock.setsockopt(zmq.PLAIN_SERVER, 1)
        sock.bind(_endpoint(host, "*"))
        port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self._pump = asyncio.get_running_loop().create_task(self._serve(sock))
        return host, port

    def drain(self) -> None:
        """The replica is shutting down: calls already running finish; every later call is answered
        ``LinkLost`` without running, so its caller sends it through Serve, to the replica's successor."""
        self.draining = True

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        for task in list(self._running.values()):
            task.cancel()
        if self._auth is not None:
            self._auth.stop()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        self._ctx = self._auth = self._sock = self._pump = None

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while (batch := await _recv_batch(sock)) is not None:
            for frames in batch:
                self._take(frames)

    def _take(self, frames: list[bytes]) -> None:
        """One message from a client (authenticated by now): a call, a cancel, or garbage."""
        ident = frames[0]
        header = _decode_header(frames[1]) if len(frames) > 1 else None
        if header is None:
            self.garbled += 1
            logger.warning("direct link: dropped a message whose header did not decode")
            return
        seq, method = header[0], header[1]
        if method is None:  # its caller left
            if (task := self._running.get((ident, seq))) is not None:
                task.cancel()
            return
        if self.draining:
            self._send_or_drop(ident, _failed(seq, "lost", "the replica is shutting down; not run"))
            return
        if len(self._running) >= self.max_in_flight:
            self.refused += 1
            self._send_or_drop(ident, _failed(seq, "busy", f"{self.max_in_flight} calls in flight; not run"))
            return
        try:
            if not isinstance(method, str) or len(frames) != 3:
                raise ValueError(f"a call is a header and a body, not {len(frames) - 1} frames")
            args = self.loads(frames[2])
            if not isinstance(args, tuple):
                raise TypeError(f"arguments must be a tuple, not {type(args).__name__}")
        except Exception as e:
            self.garbled += 1
            self._send_or_drop(
                ident, _failed(seq, "bad_frame", f"direct link: undecodable call {method!r}: {e!r}")
            )
            return
        self.calls += 1
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._run(ident, seq, method, args))
        self._running[(ident, seq)] = task
        task.add_done_callback(functools.partial(_forget, self._running, (ident, seq)))
        timeout_ms = header[2] if len(header) > 2 else None
        if isinstance(timeout_ms, int) and timeout_ms > 0:  # its caller has given up by then
            timer = loop.call_later(timeout_ms / 1000, task.cancel)
            task.add_done_callback(lambda _: timer.cancel())

    async def _run(self, ident: bytes, seq: int, method: str, args: tuple[Any, ...]) -> None:
        handler = self.handlers.get(method)
        try:
            if handler is None:
                raise LookupError(f"direct link: no method {method!r}")
            reply = self._reply(seq, OK, await handler(*args))
        except asyncio.CancelledError:
            raise  # its caller left (or its deadline passed): nobody waits for an answer
        except BaseException as e:  # the caller gets the error as Serve would give it
            reply = self._reply(seq, RAISED, e)
        await self._deliver(ident, reply)

    def _reply(self, seq: int, status: int, value: Any) -> list[bytes]:
        """The reply's frames; one whose body does not encode, or is past the bound, still answers."""
        try:
            body = self.dumps(value)
        except Exception as e:
            what = "result" if status == OK else "error"
            return _failed(seq, "bad_frame", f"direct link: unpicklable {what} {value!r}: {e!r}")
        if len(body) > self.max_frame_bytes:
            return _failed(
                seq,
                "too_large",
                f"a reply of {len(body)} bytes is past the link's {self.max_frame_bytes}-byte bound",
            )
        return [msgpack.packb([seq, status]), body]

    async def _deliver(self, ident: bytes, frames: list[bytes]) -> None:
        """Send a reply; while its client's queue is full, retry (the call keeps its slot in flight)
        for ``reply_patience_s``, then drop it."""
        delay, give_up = 0.001, time.monotonic() + self.reply_patience_s
        while True:
            try:
                self._send_now(ident, frames)
                return
            except zmq.Again:
                if time.monotonic() > give_up:
                    self.dropped += 1
                    logger.warning(
                        "direct link: a client read no reply for %.0f s; one dropped", self.reply_patience_s
                    )
                    return
                await asyncio.sleep(delay)
                delay = min(2 * delay, 0.05)

    def _send_or_drop(self, ident: bytes, frames: list[bytes]) -> None:
        """An answer that holds no slot: dropped if the client's queue is full (it reads nothing)."""
        try:
            self._send_now(ident, frames)
        except zmq.Again:
            self.dropped += 1

    def _send_now(self, ident: bytes, frames: list[bytes]) -> None:
        """Raises ``zmq.Again`` if the client's queue is full; a client that is gone is skipped."""
        if self._sock is None:
            return
        error = _send_nowait(self._sock, [ident, *frames])
        if isinstance(error, zmq.Again):
            raise error
        if error is not None:  # EHOSTUNREACH: that client disconnected
            logger.debug("direct link: reply to a departed client dropped: %r", error)


def _forget(running: dict[Any, asyncio.Task[None]], key: Any, _: asyncio.Task[None]) -> None:
    running.pop(key, None)


_client_ctx: zmq.asyncio.Context | None = None  # every client socket of this process


def _client_context() -> zmq.asyncio.Context:
    global _client_ctx
    if _client_ctx is None:
        _client_ctx = zmq.asyncio.Context()
    return _client_ctx


_HANDSHAKE_FAILED: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the server refused this link's key",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the handshake failed (a different key or mechanism)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake failed",
    zmq.EVENT_CONNECT_RETRIED: "nothing listens there",
    zmq.EVENT_DISCONNECTED: "disconnected (no heartbeat, or the peer closed)",
}
_EVENTS = functools.reduce(int.__or__, _HANDSHAKE_FAILED, int(zmq.EVENT_HANDSHAKE_SUCCEEDED))


async def _event(monitor: zmq.asyncio.Socket) -> int:
    return int(parse_monitor_message(await monitor.recv_multipart())["event"])


class LinkClient:
    """One authenticated connection to a replica's ``LinkServer``; calls are multiplexed on it by
    sequence number. Built by ``connect``, which returns once the handshake succeeded."""

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        monitor: zmq.asyncio.Socket,
        where: str,
        dumps: Dumps,
        loads: Loads,
        timeout_s: float | None,
        max_frame_bytes: int,
    ) -> None:
        self._sock = sock
        self._monitor = monitor
        self._where = where
        self._dumps = dumps
        self._loads = loads
        self._timeout_s = timeout_s
        self._max_frame_bytes = max_frame_bytes
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._seq = 0
        self.lost: BaseException | None = None
        self.retiring = False  # no new calls; closed once the last one is answered
        loop = asyncio.get_running_loop()
        self._tasks = (loop.create_task(self._read()), loop.create_task(self._watch()))

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        keys: LinkKeys,
        *,
        dumps: Dumps = _pickle,
        loads: Loads = pickle.loads,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        hwm: int = HWM,
    ) -> LinkClient:
        sock = _client_context().socket(zmq.DEALER)
        _tune(sock, hwm, max_frame_bytes, ":" in host)
        if keys.encrypt:
            sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
        else:
            sock.setsockopt(zmq.PLAIN_USERNAME, _USER)
            sock.setsockopt(zmq.PLAIN_PASSWORD, keys.client_secret)
        monitor = sock.get_monitor_socket(_EVENTS)
        where = f"{host}:{port}"
        try:
            sock.connect(_endpoint(host, port))
            async with asyncio.timeout(connect_timeout_s):
                while (event := await _event(monitor)) != zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    raise LinkLost(f"could not link to {where}: {_HANDSHAKE_FAILED.get(event, event)}")
        except BaseException as e:
            _close_socket(sock, monitor)
            if isinstance(e, TimeoutError):
                raise LinkLost(f"could not link to {where} in {connect_timeout_s} s") from e
            raise
        return cls(sock, monitor, where, dumps, loads, timeout_s, max_frame_bytes)

    async def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """``handlers[method](*args)`` on the replica; ``timeout_s`` (else the link's) is its deadline."""
        if self.lost is not None:
            raise LinkLost(f"link to {self._where} lost: {self.lost!r}")
        body = self._dumps(args)
        if len(body) > self._max_frame_bytes:
            raise FrameTooLarge(
                f"the arguments of {method!r} take {len(body)} bytes, past the link's "
                f"{self._max_frame_bytes}-byte frame bound; not sent"
            )
        self._seq += 1
        seq = self._seq
        timeout = self._timeout_s if timeout_s is None else timeout_s
        header = msgpack.packb([seq, method, None if timeout is None else max(1, int(1000 * timeout))])
        error = _send_nowait(self._sock, [header, body])
        if isinstance(error, zmq.Again):
            raise LinkBusy(f"the queue to {self._where} is full; {method!r} not sent")
        if error is not None:
            raise LinkLost(f"link to {self._where}: {error!r}") from error
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._waiting[seq] = fut
        if timeout is not None:
            self._timers[seq] = loop.call_later(timeout, self._expire, seq, method, timeout)
        try:
            return await fut
        except asyncio.CancelledError:
            if self._waiting.pop(seq, None) is not None:
                self._cancel_remote(seq)  # stop it on the replica
            raise
        finally:
            if (timer := self._timers.pop(seq, None)) is not None:
                timer.cancel()
            if self.retiring and not self._waiting:
                self.close()

    def _expire(self, seq: int, method: str, timeout: float) -> None:
        fut = self._waiting.pop(seq, None)
        if fut is not None and not fut.done():
            fut.set_exception(
                LinkTimeout(f"{method!r} on {self._where}: no answer in {timeout} s; cancelled")
            )
            self._cancel_remote(seq)

    def _cancel_remote(self, seq: int) -> None:
        if self.lost is None:  # a cancel that cannot be sent now: the header's deadline still ends it
            _send_nowait(self._sock, [msgpack.packb([seq, None, None])])

    def retire(self) -> None:
        """Take no new calls; close once every call already sent is answered."""
        self.retiring = True
        if not self._waiting:
            self.close()

    def close(self) -> None:
        self._lose(LinkLost(f"link to {self._where} closed"))

    def _lose(self, e: BaseException) -> None:
        """Fail every waiting call with ``LinkLost`` and close the connection (no reconnecting)."""
        if self.lost is not None:
            return
        self.lost = e
        waiting, self._waiting = self._waiting, {}
        for fut in waiting.values():
            if not fut.done():
                fut.set_exception(LinkLost(f"link to {self._where} broke: {e}"))
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        _close_socket(self._sock, self._monitor)

    async def _read(self) -> None:
        while (batch := await _recv_batch(self._sock)) is not None:
            for frames in batch:
                self._answer(frames)

    async def _watch(self) -> None:
        """Whatever the monitor reports after the handshake means the connection is gone."""
        try:
            event = await _event(self._monitor)
        except zmq.ZMQError:  # closed
            return
        self._lose(LinkLost(f"{self._where}: {_HANDSHAKE_FAILED.get(event, event)}"))

    def _answer(self, frames: list[bytes]) -> None:
        header = _decode_header(frames[0])
        if header is None:
            logger.warning("direct link: dropped a reply from %s whose header did not decode", self._where)
            return
        seq, status = header[0], header[1]
        fut = self._waiting.pop(seq, None)
        if fut is None or fut.done():
            return  # its caller left, or its deadline passed
        if status == FAILED:
            code, message = (header[2], header[3]) if len(header) > 3 else ("bad_frame", repr(header))
            fut.set_exception(_FAILURES.get(code, BadFrame)(message))
            return
        try:
            value = self._loads(frames[1])
        except Exception as e:
            fut.set_exception(BadFrame(f"direct link: undecodable reply from {self._where}: {e!r}"))
            return
        if status == OK:
            fut.set_result(value)
        elif isinstance(value, Exception):
            fut.set_exception(value)
        else:
            fut.set_exception(BadFrame(f"direct link: an error reply that is no exception: {value!r}"))


def _close_socket(sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
    with contextlib.suppress(zmq.ZMQError):
        sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=0)


class DirectLink:
    """Calls to a pool's one replica, reconnecting after a loss. ``locate()`` answers where that
    replica listens (the ingress asks it through Serve: ``handle.direct_address.remote()``). Callers
    that find no connection share one attempt to open it (bounded by ``CONNECT_TIMEOUT_S`` once
    located), so a lost replica costs them one wait together, not one each in turn."""

    def __init__(
        self,
        locate: Callable[[], Awaitable[tuple[str, int]]],
        keys: LinkKeys,
        dumps: Dumps = _pickle,
        loads: Loads = pickle.loads,
        *,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        hwm: int = HWM,
    ) -> None:
        self._locate = locate
        self._keys = keys
        self._options: dict[str, Any] = {
            "dumps": dumps,
            "loads": loads,
            "timeout_s": timeout_s,
            "max_frame_bytes": max_frame_bytes,
            "hwm": hwm,
        }
        self._client: LinkClient | None = None
        self._connecting: asyncio.Task[LinkClient] | None = None
        self.connects = 0
        self.losses = 0
        self._down_until = 0.0

    def usable(self) -> bool:
        """False for ``LOST_BACKOFF_S`` after a loss: meanwhile callers go through Serve, which knows
        when the replica's successor is up (asking it for an address might reach the dying one)."""
        return time.monotonic() >= self._down_until

    async def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """``method(*args)`` on the replica; ``timeout_s`` (else the link's) is the call's deadline."""
        client = self._client
        if client is None or client.lost is not None or client.retiring:
            client = await self._connect()
        try:
            return await client.call(method, *args, timeout_s=timeout_s)
        except LinkLost:
            if self._client is client:
                self._client = None
            client.retire()  # (a draining replica still answers the calls it runs)
            self.losses += 1
            self._down_until = time.monotonic() + LOST_BACKOFF_S
            raise

    async def _connect(self) -> LinkClient:
        if self._connecting is None:
            self._connecting = asyncio.get_running_loop().create_task(self._open())
            self._connecting.add_done_callback(_retrieve)
        return await asyncio.shield(self._connecting)  # a caller that leaves leaves the others' attempt

    async def _open(self) -> LinkClient:
        try:
            host, port = await self._locate()
            client = await LinkClient.connect(host, port, self._keys, **self._options)
        except Exception:
            self._down_until = time.monotonic() + LOST_BACKOFF_S
            raise
        finally:
            self._connecting = None
        self._client = client
        self.connects += 1
        return client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # read by its waiters, if any are left; never "never retrieved"
