"""The replica's end of a direct link (mmcore/link/direct_link.py): one ROUTER socket, ZAP-authenticated."""

from __future__ import annotations

import asyncio
import functools
import hmac
import inspect
import logging
import pickle
import time
from collections.abc import AsyncGenerator, Awaitable
from typing import Never, cast

import msgpack
import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from mmcore.link.frames import (
    HWM,
    MAX_FRAME_BYTES,
    MAX_IN_FLIGHT,
    MAX_IN_FLIGHT_BYTES,
    MORE,
    OK,
    PLAIN_USER,
    RAISED,
    REPLY_PATIENCE_S,
    ClientKeyCheck,
    Dumps,
    Frame,
    FrameTooLarge,
    Handler,
    LinkKeys,
    Loads,
    check_mechanism,
    decode_header,
    endpoint,
    failed_reply,
    join_body,
    pickle_dumps,
    recv_batch,
    send_nowait,
    split_body,
    tune,
)

logger = logging.getLogger("mmserve.router")


class _ReaderGone(Exception):
    """A stream's client is gone, or read nothing for ``reply_patience_s``: the stream ends unanswered."""


class _Authenticator(AsyncioAuthenticator):
    """pyzmq's ZAP authenticator, with PLAIN's password checked in constant time (``compare_digest``;
    pyzmq's own compares with ``==`` and logs the password at debug level)."""

    plain_secret: bytes | None = None

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        if self.plain_secret is None:
            return False, b"No passwords defined"
        user_ok = hmac.compare_digest(username.encode(), PLAIN_USER)
        password_ok = hmac.compare_digest(password.encode(), self.plain_secret)
        return (True, b"") if user_ok and password_ok else (False, b"Invalid credentials")


class LinkServer:
    """The replica's end: one ROUTER socket, any number of authenticated client connections.

    A handler that is an async generator function answers a stream (``LinkClient.stream``): each item
    it yields goes out as it comes, one MORE frame with the call's sequence number, then an OK frame
    (or its error). Its items are encoded by ``item_dumps`` (plain ``pickle``, no ObjectRef books: a
    stream's items must be plain records), falling back to ``dumps``; the items of ``ref_streams``
    (methods whose items carry ObjectRefs) by ``dumps`` alone, which keeps their owners. While the client's queue is full
    the generator is not resumed (it holds what it makes, as a gRPC stream does); a client that reads
    nothing for ``reply_patience_s``, or is gone, ends the stream: the generator is closed.
    """

    def __init__(
        self,
        handlers: dict[str, Handler],
        keys: LinkKeys,
        dumps: Dumps = pickle_dumps,
        loads: Loads = pickle.loads,
        *,
        item_dumps: Dumps = pickle_dumps,
        ref_streams: frozenset[str] = frozenset(),
        max_in_flight: int = MAX_IN_FLIGHT,
        max_in_flight_bytes: int = MAX_IN_FLIGHT_BYTES,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        hwm: int = HWM,
        reply_patience_s: float = REPLY_PATIENCE_S,
    ) -> None:
        self.handlers = handlers
        self.keys = keys
        self.dumps = dumps
        self.loads = loads
        self.item_dumps = item_dumps
        self.ref_streams = ref_streams
        self.max_in_flight = max_in_flight
        self.max_in_flight_bytes = max_in_flight_bytes
        self.bytes_in_flight = 0  # the running calls' argument bodies
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
        self.items = 0  # stream items sent
        self.draining = False

    async def address(self, host: str) -> tuple[str, int]:
        """Listen on ``host`` (an ephemeral port) the first time; where clients connect."""
        async with self._lock:
            if self._address is None:
                self._address = self._listen(host)
        return self._address

    def _listen(self, host: str) -> tuple[str, int]:
        check_mechanism(self.keys, host)  # PLAIN: loopback only
        self._ctx = zmq.asyncio.Context()
        self._auth = _Authenticator(self._ctx)  # before the bind: no handshake goes unchecked
        self._auth.start()
        sock = self._sock = self._ctx.socket(zmq.ROUTER)
        tune(sock, self.hwm, self.max_frame_bytes, ":" in host)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue to a client is EAGAIN, not a silent drop
        if self.keys.encrypt:
            self._auth.configure_curve_callback("*", ClientKeyCheck(self.keys.client_public))
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.server_secret)
        else:
            self._auth.plain_secret = self.keys.client_secret  # checked in constant time (_Authenticator)
            sock.setsockopt(zmq.PLAIN_SERVER, 1)
        sock.bind(endpoint(host, "*"))
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
        while (batch := await recv_batch(sock)) is not None:
            for frames in batch:
                self._take(frames)

    def _take(self, frames: list[bytes]) -> None:
        """One message from a client (authenticated by now): a call, a cancel, or garbage."""
        ident = frames[0]
        decoded = decode_header(frames[1]) if len(frames) > 1 else None
        if decoded is None:
            self.garbled += 1
            logger.warning("direct link: dropped a message whose header did not decode")
            return
        seq, header = decoded
        method = header[1]
        if method is None:  # its caller left
            if (task := self._running.get((ident, seq))) is not None:
                task.cancel()
            return
        if self.draining:
            self._send_or_drop(ident, failed_reply(seq, "lost", "the replica is shutting down; not run"))
            return
        if len(self._running) >= self.max_in_flight:
            self.refused += 1
            self._send_or_drop(
                ident, failed_reply(seq, "busy", f"{self.max_in_flight} calls in flight; not run")
            )
            return
        size = sum(len(f) for f in frames[2:])
        if self._running and self.bytes_in_flight + size > self.max_in_flight_bytes:  # alone: let in
            self.refused += 1
            self._send_or_drop(
                ident,
                failed_reply(seq, "busy", f"{self.bytes_in_flight} bytes of calls in flight; not run"),
            )
            return
        try:
            if not isinstance(method, str) or len(frames) < 3:
                raise ValueError(f"a call is a header and a body, not {len(frames) - 1} frames")
            args = self.loads(join_body(frames[2:], self.max_frame_bytes))
            if not isinstance(args, tuple):
                raise TypeError(f"arguments must be a tuple, not {type(args).__name__}")
        except Exception as e:
            self.garbled += 1
            self._send_or_drop(
                ident, failed_reply(seq, "bad_frame", f"direct link: undecodable call {method!r}: {e!r}")
            )
            return
        self.calls += 1
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._run(ident, seq, method, args))
        self._running[(ident, seq)] = task
        task.add_done_callback(functools.partial(_forget, self._running, (ident, seq)))
        self.bytes_in_flight += size
        task.add_done_callback(lambda _: self._release(size))
        timeout_ms = header[2] if len(header) > 2 else None
        if isinstance(timeout_ms, int) and timeout_ms > 0:  # its caller has given up by then
            timer = loop.call_later(timeout_ms / 1000, task.cancel)
            task.add_done_callback(lambda _: timer.cancel())

    def _release(self, size: int) -> None:
        self.bytes_in_flight -= size

    async def _run(self, ident: bytes, seq: int, method: str, args: tuple[object, ...]) -> None:
        handler = self.handlers.get(method)
        try:
            if handler is None:
                raise LookupError(f"direct link: no method {method!r}")
            result = handler(*args)
            if inspect.isasyncgen(result):
                dumps = self.dumps if method in self.ref_streams else self.item_dumps
                await self._stream(ident, seq, result, dumps)
                reply = self._reply(seq, OK, None)
            else:
                reply = self._reply(seq, OK, await cast("Awaitable[object]", result))  # not a stream
        except _ReaderGone:
            return  # its stream's reader left: nobody reads an answer
        except asyncio.CancelledError:
            if _cancelled_from_outside():
                return  # its caller left (or its deadline passed, or the server closes): nobody waits
            # the handler's own (an inner task cancelled under it): its caller waits, tell it now
            reply = failed_reply(seq, "cancelled", f"direct link: {method!r} was cancelled on the replica")
        except BaseException as e:  # the caller gets the error as Serve would give it
            reply = self._reply(seq, RAISED, e)
        await self._deliver(ident, reply)

    async def _stream(
        self, ident: bytes, seq: int, items: AsyncGenerator[object, Never], item_dumps: Dumps
    ) -> None:
        """Send each item as it comes; the generator is resumed only once the last one was queued."""
        try:
            async for item in items:
                try:
                    body = item_dumps(item)
                except Exception:  # not a plain record after all (an exception Ray made, say)
                    body = self.dumps(item)
                if len(body) > self.max_frame_bytes:
                    raise FrameTooLarge(f"a stream item of {len(body)} bytes is past the link's bound")
                if not await self._deliver(ident, [msgpack.packb([seq, MORE]), *split_body(body)]):
                    raise _ReaderGone
                self.items += 1
        finally:
            await items.aclose()  # its ``finally`` runs now, whatever ended the stream

    def _reply(self, seq: int, status: int, value: object) -> list[Frame]:
        """The reply's frames; one whose body does not encode, or is past the bound, still answers."""
        try:
            body = self.dumps(value)
        except Exception as e:
            what = "result" if status == OK else "error"
            return failed_reply(seq, "bad_frame", f"direct link: unpicklable {what} {value!r}: {e!r}")
        if len(body) > self.max_frame_bytes:
            return failed_reply(
                seq,
                "too_large",
                f"a reply of {len(body)} bytes is past the link's {self.max_frame_bytes}-byte bound",
            )
        return [msgpack.packb([seq, status]), *split_body(body)]

    async def _deliver(self, ident: bytes, frames: list[Frame]) -> bool:
        """Send a reply; while its client's queue is full, retry (the call keeps its slot in flight)
        for ``reply_patience_s``, then drop it. False: dropped, or its client is gone."""
        delay, give_up = 0.001, time.monotonic() + self.reply_patience_s
        while True:
            try:
                return self._send_now(ident, frames)
            except zmq.Again:
                if time.monotonic() > give_up:
                    self.dropped += 1
                    logger.warning(
                        "direct link: a client read no reply for %.0f s; one dropped", self.reply_patience_s
                    )
                    return False
                await asyncio.sleep(delay)
                delay = min(2 * delay, 0.05)

    def _send_or_drop(self, ident: bytes, frames: list[Frame]) -> None:
        """An answer that holds no slot: dropped if the client's queue is full (it reads nothing)."""
        try:
            self._send_now(ident, frames)
        except zmq.Again:
            self.dropped += 1

    def _send_now(self, ident: bytes, frames: list[Frame]) -> bool:
        """Raises ``zmq.Again`` if the client's queue is full; False: the client is gone (skipped)."""
        if self._sock is None:
            return False
        error = send_nowait(self._sock, [ident, *frames])
        if isinstance(error, zmq.Again):
            raise error
        if error is not None:  # EHOSTUNREACH: that client disconnected
            logger.debug("direct link: reply to a departed client dropped: %r", error)
            return False
        return True


def _cancelled_from_outside() -> bool:
    """In an ``except CancelledError``: whether this task was cancelled (``Task.cancel``: a cancel frame,
    the call's deadline, ``close``), not merely handed a ``CancelledError`` raised inside its handler."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _forget(
    running: dict[tuple[bytes, int], asyncio.Task[None]], key: tuple[bytes, int], _: asyncio.Task[None]
) -> None:
    running.pop(key, None)
