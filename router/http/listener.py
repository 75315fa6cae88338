"""Direct HTTP: the ingress replica serves the OpenAI API itself, on the port the user asked for.

Serve's HTTP proxy costs ≈ 7.5 CPU-ms per request here and ≈ 0.7 per streamed chunk it relays;
serving HTTP in the ingress replica removes that hop (what Ray Serve's "direct ingress" and vLLM's
API server do). Every ingress replica on a node binds the same address with ``SO_REUSEPORT``, so
the kernel spreads connections over them. The Serve proxy is then not started (``mmserve serve``
does this; on a cluster the proxy mode stays available for Kubernetes Services that target it).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import ASGIApp

logger = logging.getLogger("mmserve.ingress")


@dataclass(frozen=True)
class ConnectionLimits:
    """What one HTTP connection may take before its request runs (slowloris): its request line and
    headers must arrive within ``header_timeout_s`` of their first byte and hold at most
    ``max_header_bytes``, else the connection is closed; past ``max_connections`` open connections (or
    requests running) uvicorn answers 503; an idle keep-alive connection is closed after
    ``keep_alive_s``."""

    header_timeout_s: float = 10.0
    max_header_bytes: int = 64 << 10
    max_connections: int | None = 4096
    keep_alive_s: float = 30.0


class _HeadDeadline:
    """Mixed into uvicorn's HTTP protocol (httptools or h11; both start a new ``cycle`` when a request's
    head is complete): the head of each request, from its first byte (or the connection's opening),
    within ``limits.header_timeout_s`` and ``limits.max_header_bytes``."""

    limits: ConnectionLimits = ConnectionLimits()
    cycle: object | None
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    _head_timer: asyncio.TimerHandle | None = None
    _head_cycle: object | None = None
    _head_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._await_head()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and (
            self.cycle is None or getattr(self.cycle, "response_complete", False)
        ):
            self._await_head()  # the next request on a kept-alive connection begins
        super().data_received(data)  # type: ignore[misc]
        if self._head_timer is None:
            return
        if self.cycle is not self._head_cycle:  # its head is complete: the request runs
            self._stop_head()
            return
        self._head_bytes += len(data)  # all of it head: the head is still incomplete
        if self._head_bytes > self.limits.max_header_bytes:
            self._close("request head past %d bytes", self.limits.max_header_bytes)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head()
        super().connection_lost(exc)  # type: ignore[misc]

    def _await_head(self) -> None:
        self._head_cycle, self._head_bytes = self.cycle, 0
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_late)

    def _stop_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.cycle is self._head_cycle:
            self._close("no whole request head in %.0f s", self.limits.header_timeout_s)

    def _close(self, why: str, value: float) -> None:
        self._stop_head()
        logger.debug("HTTP connection closed: " + why, value)
        self.transport.close()


def http_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (httptools where installed, else h11) with ``_HeadDeadline``."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return type("HeadDeadlineProtocol", (_HeadDeadline, AutoHTTPProtocol), {"limits": limits})


def bind_reuseport(host: str, port: int) -> socket.socket:
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:  # a name such as localhost
        family = socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class DirectHTTPServer:
    """uvicorn on the current event loop, over a socket shared by the node's ingress replicas."""

    def __init__(
        self, app: ASGIApp, host: str, port: int, limits: ConnectionLimits = ConnectionLimits()
    ) -> None:
        import uvicorn

        self.host, self.port = host, port
        self._sock = bind_reuseport(host, port)
        config = uvicorn.Config(
            app,
            loop="none",
            lifespan="off",
            access_log=False,
            log_level="warning",
            http=http_protocol(limits),
            timeout_keep_alive=int(limits.keep_alive_s),
            limit_concurrency=limits.max_connections,
            h11_max_incomplete_event_size=limits.max_header_bytes,
        )
        self._server = uvicorn.Server(config)
        # Signals belong to the replica process (Serve), not to this server.
        self._server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
        self.task: asyncio.Task[None] = asyncio.get_running_loop().create_task(
            self._server.serve(sockets=[self._sock])
        )
        logger.info("serving HTTP on %s:%d", host, port)

    def check(self) -> None:
        if self.task.done():
            why = "cancelled" if self.task.cancelled() else repr(self.task.exception())
            raise RuntimeError(f"the HTTP server on {self.host}:{self.port} stopped: {why}")

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop accepting connections, let responses in flight finish (up to ``timeout_s``), stop."""
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout_s)
        except Exception:
            self.task.cancel()
        self._sock.close()
