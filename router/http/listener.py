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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import ASGIApp

logger = logging.getLogger("mmserve.ingress")


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

    def __init__(self, app: ASGIApp, host: str, port: int) -> None:
        import uvicorn

        self.host, self.port = host, port
        self._sock = bind_reuseport(host, port)
        config = uvicorn.Config(
            app, loop="none", lifespan="off", access_log=False, log_level="warning", timeout_keep_alive=30
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
