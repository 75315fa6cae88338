"""mmcore/link/direct_link.py on real loopback ZeroMQ sockets: answers, errors, cancellation, a lost link,
draining, deadlines, the in-flight bound, one shared reconnect."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mmcore.link.direct_link import (
    CallCancelled,
    DirectLink,
    LinkBusy,
    LinkClient,
    LinkKeys,
    LinkLost,
    LinkServer,
    LinkTimeout,
)
from router.protocol.errors import from_exception, replica_gone
from tests.unit.mmcore.link.peers import until

KEYS = LinkKeys.generate()


class Boom(ValueError):
    pass


def _server(keys: LinkKeys = KEYS, **extra: Any) -> tuple[LinkServer, dict[str, Any]]:
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
    return LinkServer(handlers, keys), seen


def test_calls_are_answered_in_any_order_and_errors_come_back_as_raised() -> None:
    async def run() -> None:
        server, _ = _server()
        host, port = await server.address("127.0.0.1")
        client = await LinkClient.connect(host, port, KEYS)
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


def test_a_server_on_ipv6_loopback_answers() -> None:
    async def run() -> None:
        server, _ = _server()
        link = DirectLink(lambda: server.address("::1"), KEYS)
        assert await link.call("echo", "six") == ("echo", ("six",))
        link.close()
        await server.close()

    asyncio.run(run())


def test_the_unencrypted_mode_authenticates_with_the_secret() -> None:
    async def run() -> None:
        keys = LinkKeys.generate(encrypt=False)
        server, _ = _server(keys)
        host, port = await server.address("127.0.0.1")
        client = await LinkClient.connect(host, port, keys)
        assert await client.call("echo", 1) == ("echo", (1,))
        other = LinkKeys.generate(encrypt=False)
        with pytest.raises(LinkLost, match="refused"):
            await LinkClient.connect(host, port, other)  # another cluster's secret
        assert server.calls == 1
        client.close()
        await server.close()

    asyncio.run(run())


def test_a_caller_that_leaves_cancels_the_call_on_the_server() -> None:
    async def run() -> None:
        server, seen = _server()
        host, port = await server.address("127.0.0.1")
        client = await LinkClient.connect(host, port, KEYS)
        call = asyncio.ensure_future(client.call("hang"))
        await asyncio.wait_for(seen["started"].wait(), 5)
        call.cancel()
        await asyncio.wait_for(seen["cancelled"].wait(), 5)
        assert await client.call("echo", "still open") == ("echo", ("still open",))
        client.close()
        await server.close()

    asyncio.run(run())


def test_a_deadline_fails_the_one_call_and_cancels_it_on_the_server() -> None:
    async def run() -> None:
        server, seen = _server()
        link = DirectLink(lambda: server.address("127.0.0.1"), KEYS, timeout_s=30.0)
        with pytest.raises(LinkTimeout) as e:
            await link.call("hang", timeout_s=0.2)
        assert from_exception(e.value) is not None and from_exception(e.value).status_code == 504  # type: ignore[union-attr]
        await asyncio.wait_for(seen["cancelled"].wait(), 5)
        assert await link.call("echo", 1) == ("echo", (1,))  # same connection, not a loss
        assert link.connects == 1 and link.losses == 0 and link.usable()
        link.close()
        await server.close()

    asyncio.run(run())


def test_past_the_in_flight_bound_a_call_is_refused_at_once_with_a_503() -> None:
    async def run() -> None:
        server, seen = _server()
        server.max_in_flight = 2
        host, port = await server.address("127.0.0.1")
        client = await LinkClient.connect(host, port, KEYS)
        hanging = [asyncio.ensure_future(client.call("hang")) for _ in range(2)]
        await asyncio.wait_for(seen["started"].wait(), 5)
        await until(lambda: len(server._running) == 2, "two calls running")
        with pytest.raises(LinkBusy) as e:
            await client.call("echo", "third")
        api = from_exception(e.value)
        assert api is not None and api.status_code == 503 and not replica_gone(e.value)
        assert server.refused == 1 and server.calls == 2
        for call in hanging:
            call.cancel()
        await until(lambda: not server._running, "the cancelled calls ended")
        assert await client.call("echo", "after") == ("echo", ("after",))
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

        link = DirectLink(locate, KEYS)
        assert await link.call("echo", 1) == ("echo", (1,))
        waiting = asyncio.ensure_future(link.call("hang"))
        await asyncio.wait_for(seen["started"].wait(), 5)
        await first.close()  # the replica dies: its socket and connections go away
        with pytest.raises(LinkLost) as e:
            await asyncio.wait_for(waiting, 10)
        assert replica_gone(e.value) and link.losses == 1 and not link.usable()
        assert seen["cancelled"].is_set()
        assert await link.call("echo", 2) == ("echo", (2,))  # through the successor
        assert located == addresses and link.connects == 2
        link.close()
        await second.close()

    asyncio.run(run())


def test_callers_that_find_the_link_down_share_one_attempt_to_open_it() -> None:
    async def run() -> None:
        server, _ = _server()
        asked = 0
        gate = asyncio.Event()

        async def locate() -> tuple[str, int]:
            nonlocal asked
            asked += 1
            await gate.wait()
            return await server.address("127.0.0.1")

        link = DirectLink(locate, KEYS)
        calls = [asyncio.ensure_future(link.call("echo", i)) for i in range(20)]
        calls[0].cancel()  # the caller that started the attempt leaves; the others keep it
        await asyncio.sleep(0.05)
        gate.set()
        answers = await asyncio.gather(*calls[1:])
        assert answers == [("echo", (i,)) for i in range(1, 20)]
        assert asked == 1 and link.connects == 1
        link.close()
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
        client = await LinkClient.connect(host, port, KEYS)
        running = asyncio.ensure_future(client.call("slow", "first"))
        await until(lambda: ran, "the slow call started")
        server.drain()  # the replica's shutdown hook
        with pytest.raises(LinkLost, match="shutting down"):
            await client.call("slow", "late")
        release.set()
        assert await running == "first"
        assert ran == ["first"]
        client.close()
        await server.close()

    asyncio.run(run())


def test_a_link_whose_replica_drains_lets_its_running_calls_finish_then_rests() -> None:
    async def run() -> None:
        release = asyncio.Event()

        async def slow() -> str:
            await release.wait()
            return "done"

        server, _ = _server(slow=slow)
        link = DirectLink(lambda: server.address("127.0.0.1"), KEYS)
        running = asyncio.ensure_future(link.call("slow"))
        await until(lambda: server._running, "the slow call running")
        server.drain()
        with pytest.raises(LinkLost):
            await link.call("echo", 1)
        assert not link.usable() and link.losses == 1
        release.set()
        assert await running == "done"  # the retired connection still answered it
        link.close()
        await server.close()

    asyncio.run(run())


def test_a_handler_cancelled_by_its_own_doing_is_answered_at_once_not_at_the_deadline() -> None:
    async def raises_cancelled() -> None:
        raise asyncio.CancelledError

    async def inner_task_cancelled() -> None:  # what an encode does when its batch is cancelled under it
        inner = asyncio.ensure_future(asyncio.sleep(60))
        asyncio.get_running_loop().call_soon(inner.cancel)
        await inner

    async def run() -> None:
        server, _ = _server(raises=raises_cancelled, inner=inner_task_cancelled)
        host, port = await server.address("127.0.0.1")
        client = await LinkClient.connect(host, port, KEYS, timeout_s=300.0)  # a prepare's deadline
        for method in ("raises", "inner"):
            with pytest.raises(CallCancelled, match=f"'{method}' was cancelled on the replica") as e:
                await asyncio.wait_for(client.call(method), 5)  # not the 300 s deadline
            api = from_exception(e.value)
            assert api is not None and api.status_code == 503 and api.code == "replica_call_cancelled"
        assert await client.call("echo", "still open") == ("echo", ("still open",))
        client.close()
        await server.close()

    asyncio.run(run())
