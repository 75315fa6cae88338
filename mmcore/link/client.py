"""The caller's end of a direct link (mmcore/link/direct_link.py): one DEALER socket per connection, its
handshake and liveness watched through a socket monitor."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import pickle
from collections.abc import AsyncGenerator
from typing import Any, cast

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from mmcore.link.frames import (
    CONNECT_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    FAILED,
    FAILURES,
    HWM,
    MAX_FRAME_BYTES,
    MORE,
    OK,
    PLAIN_USER,
    RAISED,
    BadFrame,
    Dumps,
    FrameTooLarge,
    LinkBusy,
    LinkKeys,
    LinkLost,
    LinkTimeout,
    Loads,
    check_mechanism,
    decode_header,
    endpoint,
    join_body,
    pickle_dumps,
    recv_batch,
    send_nowait,
    split_body,
    tune,
)

logger = logging.getLogger("mmserve.router")

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


_Reply = tuple[int, object]  # (OK or MORE, a value), or (RAISED, the exception to raise)


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
        self._waiting: dict[int, asyncio.Future[object]] = {}
        self._streams: dict[int, asyncio.Queue[_Reply]] = {}  # seq -> (status, item) as they come
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
        dumps: Dumps = pickle_dumps,
        loads: Loads = pickle.loads,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        hwm: int = HWM,
    ) -> LinkClient:
        check_mechanism(keys, host)  # PLAIN: its secret goes out in clear, so to loopback only
        sock = _client_context().socket(zmq.DEALER)
        tune(sock, hwm, max_frame_bytes, ":" in host)
        if keys.encrypt:
            sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
        else:
            sock.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USER)
            sock.setsockopt(zmq.PLAIN_PASSWORD, keys.client_secret)
        monitor = sock.get_monitor_socket(_EVENTS)
        where = f"{host}:{port}"
        try:
            sock.connect(endpoint(host, port))
            async with asyncio.timeout(connect_timeout_s):
                while (event := await _event(monitor)) != zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    raise LinkLost(f"could not link to {where}: {_HANDSHAKE_FAILED.get(event, event)}")
        except BaseException as e:
            _close_socket(sock, monitor)
            if isinstance(e, TimeoutError):
                raise LinkLost(f"could not link to {where} in {connect_timeout_s} s") from e
            raise
        return cls(sock, monitor, where, dumps, loads, timeout_s, max_frame_bytes)

    async def call(
        self, method: str, *args: object, timeout_s: float | None = None
    ) -> Any:  # Any: what the replica's handler returns; its caller names the type
        """``handlers[method](*args)`` on the replica; ``timeout_s`` (else the link's) is its deadline."""
        seq, timeout = self._send(method, args, self._timeout_s if timeout_s is None else timeout_s)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[object] = loop.create_future()
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
            self._settled(seq)

    async def stream(
        self, method: str, *args: object, timeout_s: float | None = None
    ) -> AsyncGenerator[Any, None]:  # Any: what the replica's handler yields; its caller names the type
        """The items of ``handlers[method](*args)``, an async generator on the replica, in the order it
        yields them (one MORE frame each, same sequence number), until it returns (an OK frame) or
        raises (that error, here). ``timeout_s`` bounds the whole stream (None: no deadline; the
        connection's heartbeats still fail it with ``LinkLost``). Leaving early cancels it there."""
        seq, timeout = self._send(method, args, timeout_s)
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[_Reply] = asyncio.Queue()
        self._streams[seq] = items
        if timeout is not None:
            self._timers[seq] = loop.call_later(timeout, self._expire, seq, method, timeout)
        try:
            while True:
                status, value = await items.get()
                if status == MORE:
                    yield value
                elif status == OK:
                    return
                else:
                    raise cast(BaseException, value)  # RAISED: the error (_decode)
        finally:
            if self._streams.pop(seq, None) is not None:  # left before its end: stop it on the replica
                self._cancel_remote(seq)
            self._settled(seq)

    def _send(self, method: str, args: tuple[object, ...], timeout: float | None) -> tuple[int, float | None]:
        """Send a call's frames; its sequence number. Raises before anything is sent."""
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
        header = msgpack.packb([seq, method, None if timeout is None else max(1, int(1000 * timeout))])
        error = send_nowait(self._sock, [header, *split_body(body)])
        if isinstance(error, zmq.Again):
            raise LinkBusy(f"the queue to {self._where} is full; {method!r} not sent")
        if error is not None:
            raise LinkLost(f"link to {self._where}: {error!r}") from error
        return seq, timeout

    def _settled(self, seq: int) -> None:
        if (timer := self._timers.pop(seq, None)) is not None:
            timer.cancel()
        if self.retiring and not self._waiting and not self._streams:
            self.close()

    def _expire(self, seq: int, method: str, timeout: float) -> None:
        error = LinkTimeout(f"{method!r} on {self._where}: no answer in {timeout} s; cancelled")
        fut = self._waiting.pop(seq, None)
        if fut is not None and not fut.done():
            fut.set_exception(error)
            self._cancel_remote(seq)
        elif (items := self._streams.pop(seq, None)) is not None:
            items.put_nowait((RAISED, error))
            self._cancel_remote(seq)

    def _cancel_remote(self, seq: int) -> None:
        if self.lost is None:  # a cancel that cannot be sent now: the header's deadline still ends it
            send_nowait(self._sock, [msgpack.packb([seq, None, None])])

    def retire(self) -> None:
        """Take no new calls; close once every call already sent is answered."""
        self.retiring = True
        if not self._waiting and not self._streams:
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
        streams, self._streams = self._streams, {}
        for items in streams.values():
            items.put_nowait((RAISED, LinkLost(f"link to {self._where} broke: {e}")))
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        _close_socket(self._sock, self._monitor)

    async def _read(self) -> None:
        while (batch := await recv_batch(self._sock)) is not None:
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
        decoded = decode_header(frames[0])
        if decoded is None:
            logger.warning("direct link: dropped a reply from %s whose header did not decode", self._where)
            return
        seq, header = decoded
        if seq in self._streams:
            self._stream_item(seq, header, frames)
            return
        fut = self._waiting.pop(seq, None)
        if fut is None or fut.done():
            return  # its caller left, or its deadline passed
        status, value = self._decode(header, frames)
        if status == OK:
            fut.set_result(value)
        elif status == MORE:  # the method streams: ``stream`` reads it, ``call`` cannot
            fut.set_exception(BadFrame(f"direct link: seq {seq} answers a stream; read it with stream()"))
            self._cancel_remote(seq)
        else:
            fut.set_exception(cast(BaseException, value))  # RAISED: the error (_decode)

    def _stream_item(self, seq: int, header: list[object], frames: list[bytes]) -> None:
        """One frame of a stream: an item (MORE) queued in order, or its end (which ends it here)."""
        items = self._streams[seq]
        status, value = self._decode(header, frames)
        if status != MORE:
            del self._streams[seq]
            if isinstance(value, BadFrame) and header[1] == MORE:  # an item lost: the rest is no use
                self._cancel_remote(seq)
        items.put_nowait((status, value))

    def _decode(self, header: list[object], frames: list[bytes]) -> _Reply:
        """``(OK or MORE, value)``, or ``(RAISED, the exception to raise)``; ``header[1]`` is the status."""
        status = header[1]
        if status == FAILED:
            code, message = (header[2], header[3]) if len(header) > 3 else ("bad_frame", repr(header))
            return RAISED, FAILURES.get(str(code), BadFrame)(message)
        try:
            value = self._loads(join_body(frames[1:], self._max_frame_bytes))
        except Exception as e:
            return RAISED, BadFrame(f"direct link: undecodable reply from {self._where}: {e!r}")
        if status in (OK, MORE):
            return (OK if status == OK else MORE), value
        if isinstance(value, Exception):
            return RAISED, value
        return RAISED, BadFrame(f"direct link: an error reply that is no exception: {value!r}")


def _close_socket(sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
    with contextlib.suppress(zmq.ZMQError):
        sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=0)
