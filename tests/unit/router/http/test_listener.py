"""router/http/listener.py: the direct HTTP server's bounds against slow or oversized request heads
(slowloris), idle kept-alive connections and too many open connections, on loopback; requests that
keep to them are served, on kept-alive connections too."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from router.http.listener import ConnectionLimits, DirectHTTPServer


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"n": len(await request.body())})

    return app


def _serve(limits: ConnectionLimits, check: Callable[[int], Awaitable[None]]) -> None:
    async def run() -> None:
        server = DirectHTTPServer(_app(), "127.0.0.1", 0, limits)
        port = int(server._sock.getsockname()[1])
        try:
            await asyncio.sleep(0.05)  # uvicorn starts serving on this loop
            await check(port)
        finally:
            await server.shutdown(1.0)

    asyncio.run(run())


async def _closed_by_server(reader: asyncio.StreamReader, within_s: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), within_s) == b""
    except ConnectionResetError:
        return True


def test_a_request_head_that_dribbles_in_is_cut_off_at_the_header_timeout() -> None:
    async def check(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\n")
        closed = asyncio.ensure_future(_closed_by_server(reader, 10))
        for i in range(100):  # a header every 50 ms, never the blank line that ends the head
            if closed.done():
                break
            writer.write(b"X-%d: y\r\n" % i)
            await asyncio.sleep(0.05)
        assert await closed
        writer.close()

    _serve(ConnectionLimits(header_timeout_s=0.5), check)


def test_a_connection_that_sends_nothing_is_closed_at_the_header_timeout() -> None:
    async def check(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await _closed_by_server(reader, 10)
        writer.close()

    _serve(ConnectionLimits(header_timeout_s=0.3), check)


def test_a_request_head_past_max_header_bytes_is_refused() -> None:
    async def check(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\n" + b"X-big: " + b"a" * (64 << 10) + b"\r\n")
        head = await asyncio.wait_for(reader.read(), 10)  # closed (h11 answers 431/400 first)
        assert head == b"" or head.split(b" ")[1] in (b"400", b"431")
        writer.close()

    _serve(ConnectionLimits(header_timeout_s=30, max_header_bytes=8 << 10), check)


def test_requests_within_the_bounds_are_served_on_a_kept_alive_connection() -> None:
    async def check(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(2):  # the second one after more than the header timeout of idleness
            writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")
            await asyncio.sleep(0.4)  # a slow body is not a slow head
            writer.write(b"hello")
            status = await asyncio.wait_for(reader.readline(), 10)
            assert status.startswith(b"HTTP/1.1 200"), status
            while await reader.readline() != b"\r\n":  # the response's headers
                pass
            assert await reader.readexactly(len(b'{"n":5}')) == b'{"n":5}'
            await asyncio.sleep(0.4)
        writer.close()

    _serve(ConnectionLimits(header_timeout_s=0.3), check)


async def _post(port: int) -> bytes:
    """One request on a new connection: its status line."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
    status = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    return status


async def _until(cond: Callable[[], bool], within_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_past_max_connections_a_request_is_answered_503_until_connections_close() -> None:
    """Idle connections that hold the server's ``max_connections`` (a slowloris that opens many
    connections, each within its header timeout) get a further request a 503, not a run of the app;
    once some close, requests are served again."""

    async def run() -> None:
        server = DirectHTTPServer(
            _app(), "127.0.0.1", 0, ConnectionLimits(header_timeout_s=30, max_connections=4)
        )
        port = int(server._sock.getsockname()[1])
        open_now = server._server.server_state.connections  # uvicorn's set of open connections
        try:
            idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
            await _until(lambda: len(open_now) == 4)  # accepted, each waiting for its head
            assert (await _post(port)).startswith(b"HTTP/1.1 503"), "a 5th connection ran a request"
            for _, writer in idle[:2]:
                writer.close()
            await _until(lambda: len(open_now) == 2)
            assert (await _post(port)).startswith(b"HTTP/1.1 200")
            for _, writer in idle[2:]:
                writer.close()
        finally:
            await server.shutdown(1.0)

    asyncio.run(run())


def test_an_idle_kept_alive_connection_is_closed_after_keep_alive_s() -> None:
    """After a response, a connection that sends nothing more is closed at ``keep_alive_s`` (the
    header timeout, far longer, is not what closes it)."""

    async def check(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        assert (await asyncio.wait_for(reader.readline(), 10)).startswith(b"HTTP/1.1 200")
        t0 = asyncio.get_running_loop().time()
        while await asyncio.wait_for(reader.readline(), 10) != b"\r\n":  # the response's headers
            pass
        await reader.readexactly(len(b'{"n":5}'))
        assert await _closed_by_server(reader, 10)
        assert asyncio.get_running_loop().time() - t0 < 5  # keep_alive_s=1, not header_timeout_s=30
        writer.close()

    _serve(ConnectionLimits(header_timeout_s=30, keep_alive_s=1), check)
