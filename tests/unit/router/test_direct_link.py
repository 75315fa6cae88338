"""router/direct_link.py on real loopback sockets: answers, errors, the token, cancellation, a lost link."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from router.direct_link import DirectLink, LinkClient, LinkLost, LinkServer
from router.errors import replica_gone

TOKEN = "t0ken"


class Boom(ValueError):
    pass


def _server(**extra: Any) -> tuple[LinkServer, dict[str, Any]]:
    seen: dict[str, Any] = {"cancelled": asyncio.Event(), "started": asyncio.Event()}

    async def echo(*args: Any) -> Any:
        return ("echo", args)

    async def fail(message: str) -> None:
        raise Boom(message)

    async def hang() -> None:
        seen["started"].set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen["cancelled"].set()
            raise

    handlers = {"echo": echo, "fail": fail, "hang": hang, **extra}
    return LinkServer(handlers, TOKEN), seen


def test_calls_are_answered_in_any_order_and_errors_come_back_as_raised() -> None:
    async def run() -> None:
        server, _ = _server()
        host, port = await server.address("127.0.0.1")
        client = await LinkClient.connect(host, port, TOKEN)
        answers = await asyncio.gather(*(client.call("echo", i, {"k": [i]}) for i in range(50)))
        assert answers == [("echo", (i, {"k": [i]})) for i in range(50)]
        with pytest.raises(Boom, match="bad item 3"):
            await client.call("fail", "bad item 3")
        with pytest.raises(LookupError, match="no method 'nope'"):
            await client.call("nope")
        assert server.calls == 52
        client.close()
        await server.close()

    asyncio.run(run())


def test_a_connection_without_the_token_is_hung_up_on() -> None:
    async def run() -> None:
        server, _ = _server()
        host, port = await server.address("127.0.0.1")
        client = await LinkClient.connect(host, port, "wrong")
        with pytest.raises(LinkLost) as e:
            await client.call("echo", 1)
        assert replica_gone(e.value)
        assert server.calls == 0
        await server.close()

    asyncio.run(run())


def test_a_caller_that_leaves_cancels_the_call_on_the_server() -> None:
    async def run() -> None:
        server, seen = _server()
        host, port = await server.address("127.0.0.1")
        client = await LinkClient.connect(host, port, TOKEN)
        call = asyncio.ensure_future(client.call("hang"))
        await asyncio.wait_for(seen["started"].wait(), 5)
        call.cancel()
        await asyncio.wait_for(seen["cancelled"].wait(), 5)
        assert await client.call("echo", "still open") == ("echo", ("still open",))
        client.close()
        await server.close()

    asyncio.run(run())


def test_a_lost_connection_fails_waiting_calls_and_the_link_reconnects_where_locate_says() -> None:
    async def run() -> None:
        first, seen = _server()
        second, _ = _server()
        addresses = [await first.address("127.0.0.1"), await second.address("127.0.0.1")]
        located: list[tuple[str, int]] = []

        async def locate() -> tuple[str, int]:
            located.append(addresses[len(located)])
            return located[-1]

        link = DirectLink(locate, TOKEN)
        assert await link.call("echo", 1) == ("echo", (1,))
        waiting = asyncio.ensure_future(link.call("hang"))
        await asyncio.wait_for(seen["started"].wait(), 5)
        # the replica dies: its server and connections go away
        await first.close()
        assert link._client is not None
        link._client._writer.transport.abort()
        with pytest.raises(LinkLost):
            await asyncio.wait_for(waiting, 5)
        await asyncio.wait_for(seen["cancelled"].wait(), 5)  # its call ended with its connection
        assert await link.call("echo", 2) == ("echo", (2,))  # through the successor
        assert located == addresses and link.connects == 2
        link.close()
        await second.close()

    asyncio.run(run())


PWNED: list[str] = []


def _pwn() -> None:
    PWNED.append("unpickled")


class _Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return (_pwn, ())


def test_nothing_is_unpickled_from_a_peer_before_its_token_matched() -> None:
    import pickle
    import struct

    async def run() -> None:
        server, _ = _server()
        host, port = await server.address("127.0.0.1")
        reader, writer = await asyncio.open_connection(host, port)
        body = pickle.dumps((1, "echo", (_Payload(),)))
        writer.write(struct.pack("!I", len(body)) + body)  # a call frame where the token belongs
        assert await asyncio.wait_for(reader.read(), 5) == b""  # hung up on
        writer.close()
        assert PWNED == [] and server.calls == 0
        await server.close()

    asyncio.run(run())


def test_a_draining_server_finishes_running_calls_and_refuses_later_ones_unrun() -> None:
    async def run() -> None:
        release = asyncio.Event()
        ran: list[str] = []

        async def slow(name: str) -> str:
            ran.append(name)
            await release.wait()
            return name

        server, _ = _server(slow=slow)
        host, port = await server.address("127.0.0.1")
        client = await LinkClient.connect(host, port, TOKEN)
        running = asyncio.ensure_future(client.call("slow", "first"))
        while not ran:
            await asyncio.sleep(0.01)
        server.drain()  # the replica's shutdown hook
        with pytest.raises(LinkLost, match="shutting down"):
            await client.call("slow", "late")
        release.set()
        assert await running == "first"
        assert ran == ["first"]
        client.close()

    asyncio.run(run())
